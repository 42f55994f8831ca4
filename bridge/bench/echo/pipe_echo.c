/* The physical floor for the Port lane: read each length-prefixed request frame from stdin in
 * full, answer with one frame of a fixed reply size on stdout. No decoding, no compute: the
 * cost of moving the same bytes through the same pipes (which it enlarges to 1 MiB, as the
 * server does).
 *
 *   pipe_echo REPLY_BYTES [READ_BYTES]
 *     REPLY_BYTES  reply frame body size in bytes (0: echo the request body back)
 *     READ_BYTES   bytes of its own memory read before each reply (default 0): the floor of a
 *                  server that must read that much, a model's weights say, to answer
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame_io.h"

int main(int argc, char **argv) {
    size_t reply_bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : 0;
    size_t read_bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : 0;
    fcntl(0, F_SETPIPE_SZ, 1 << 20);
    fcntl(1, F_SETPIPE_SZ, 1 << 20);
    uint8_t *reply = reply_bytes ? malloc(reply_bytes) : NULL;
    if (reply_bytes && !reply) return 2;
    /* Written once so that it is backed by real pages: untouched calloc memory maps every page
     * to the kernel's one zero page, which stays in cache and makes the floor too cheap. */
    if (reply_bytes) memset(reply, 0xA5, reply_bytes);
    uint8_t *must_read = read_bytes ? malloc(read_bytes) : NULL;
    if (read_bytes && !must_read) return 2;
    if (read_bytes) memset(must_read, 0xA5, read_bytes);
    return echo_frames(0, 1, reply_bytes, reply, must_read, read_bytes);
}

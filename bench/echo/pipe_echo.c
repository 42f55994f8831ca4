/* The physical floor for the Port lane: read each length-prefixed request frame from stdin in
 * full, answer with one frame of a fixed reply size on stdout. No decoding, no compute: the
 * cost of moving the same bytes through the same pipes (which it enlarges to 1 MiB, as the
 * server does).
 *
 *   pipe_echo REPLY_BYTES     reply frame body size in bytes (0: echo the request body back)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

static int read_exact(int fd, uint8_t *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r == 0) return 0;
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        got += (size_t)r;
    }
    return 1;
}

static int write_all(int fd, struct iovec *iov, int count) {
    while (count > 0) {
        ssize_t w = writev(fd, iov, count);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        while (count > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    size_t reply_bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : 0;
    fcntl(0, F_SETPIPE_SZ, 1 << 20);
    fcntl(1, F_SETPIPE_SZ, 1 << 20);
    size_t cap = 1 << 20;
    uint8_t *body = malloc(cap);
    uint8_t *reply = reply_bytes ? malloc(reply_bytes) : NULL;
    if (!body || (reply_bytes && !reply)) return 2;
    /* Written once so that it is backed by real pages: untouched calloc memory maps every page
     * to the kernel's one zero page, which stays in cache and makes the floor too cheap. */
    if (reply_bytes) memset(reply, 0xA5, reply_bytes);
    for (;;) {
        uint8_t header[4];
        int r = read_exact(0, header, 4);
        if (r <= 0) return r < 0 ? 1 : 0;
        size_t len = ((size_t)header[0] << 24) | ((size_t)header[1] << 16) |
                     ((size_t)header[2] << 8) | (size_t)header[3];
        if (len > cap) {
            free(body);
            cap = len;
            body = malloc(cap);
            if (!body) return 2;
        }
        if (read_exact(0, body, len) <= 0) return 1;
        size_t out_len = reply_bytes ? reply_bytes : len;
        uint8_t out_header[4] = {(uint8_t)(out_len >> 24), (uint8_t)(out_len >> 16),
                                 (uint8_t)(out_len >> 8), (uint8_t)out_len};
        struct iovec iov[2] = {{out_header, 4}, {reply_bytes ? reply : body, out_len}};
        if (write_all(1, iov, 2) < 0) return 1;
    }
}

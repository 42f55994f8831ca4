/* The physical floor for the unix-socket lane: listen on a unix socket, and on each connection
 * read every length-prefixed request frame in full and answer with one frame of a fixed reply
 * size. No decoding, no compute: the cost of moving the same bytes through the same kind of
 * socket, with the socket buffers the server gives its connections. Connections are served one
 * after another. Prints PATH on stdout once listening.
 *
 *   unix_echo PATH REPLY_BYTES [BUFFER_BYTES]
 *     REPLY_BYTES    reply frame body size in bytes (0: echo the request body back)
 *     BUFFER_BYTES   SO_SNDBUF and SO_RCVBUF of each connection (bridge/transports/unix.py's
 *                    SOCKET_BUFFER_BYTES); the system's default where absent or 0
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#ifdef __linux__
#include <signal.h>
#include <sys/prctl.h>
#endif

#include "frame_io.h"

int main(int argc, char **argv) {
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: unix_echo PATH REPLY_BYTES [BUFFER_BYTES]\n");
        return 2;
    }
#ifdef __linux__
    /* A bench killed before it can stop this one (SIGTERM, SIGKILL) takes it along instead of
     * leaving it running, re-parented; pipe_echo ends with its stdin. */
    prctl(PR_SET_PDEATHSIG, SIGTERM);
#endif
    size_t reply_bytes = strtoull(argv[2], NULL, 10);
    int buffer_bytes = argc == 4 ? atoi(argv[3]) : 0;
    uint8_t *reply = reply_bytes ? malloc(reply_bytes) : NULL;
    if (reply_bytes && !reply) return 2;
    /* Written once so that it is backed by real pages: untouched calloc memory maps every page
     * to the kernel's one zero page, which stays in cache and makes the floor too cheap. */
    if (reply_bytes) memset(reply, 0xA5, reply_bytes);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(argv[1]) >= sizeof addr.sun_path) {
        fprintf(stderr, "unix_echo: path too long: %s\n", argv[1]);
        return 2;
    }
    strcpy(addr.sun_path, argv[1]);
    unlink(argv[1]);
    int listener = socket(AF_UNIX, SOCK_STREAM, 0);
    if (listener < 0 || bind(listener, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(listener, 8) < 0) {
        perror("unix_echo");
        return 1;
    }
    printf("%s\n", argv[1]);  /* ready: the caller waits for this line */
    fflush(stdout);
    for (;;) {
        int fd = accept(listener, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR) continue;
            perror("unix_echo: accept");
            return 1;
        }
        if (buffer_bytes > 0 && (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof buffer_bytes) < 0 ||
                                 setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof buffer_bytes) < 0)) {
            perror("unix_echo: setsockopt");
            return 1;
        }
        echo_frames(fd, fd, reply_bytes, reply, NULL, 0);  /* until the peer closes it */
        close(fd);
    }
}

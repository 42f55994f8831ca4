/* The physical floor for the unix-socket lane: listen on a unix socket, and on each connection
 * read every length-prefixed request frame in full and answer with one frame of a fixed reply
 * size. No decoding, no compute: the cost of moving the same bytes through the same kind of
 * socket. Connections are served one after another. Prints PATH on stdout once listening.
 *
 *   unix_echo PATH REPLY_BYTES     reply frame body size in bytes (0: echo the request body back)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
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

/* Serve one connection until the peer closes it. */
static void serve(int fd, size_t reply_bytes, const uint8_t *reply) {
    size_t cap = 1 << 20;
    uint8_t *body = malloc(cap);
    if (!body) return;
    for (;;) {
        uint8_t header[4];
        if (read_exact(fd, header, 4) <= 0) break;
        size_t len = ((size_t)header[0] << 24) | ((size_t)header[1] << 16) |
                     ((size_t)header[2] << 8) | (size_t)header[3];
        if (len > cap) {
            free(body);
            cap = len;
            body = malloc(cap);
            if (!body) return;
        }
        if (read_exact(fd, body, len) <= 0) break;
        size_t out_len = reply_bytes ? reply_bytes : len;
        uint8_t out_header[4] = {(uint8_t)(out_len >> 24), (uint8_t)(out_len >> 16),
                                 (uint8_t)(out_len >> 8), (uint8_t)out_len};
        struct iovec iov[2] = {{out_header, 4}, {reply_bytes ? (void *)reply : body, out_len}};
        if (write_all(fd, iov, 2) < 0) break;
    }
    free(body);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: unix_echo PATH REPLY_BYTES\n");
        return 2;
    }
    size_t reply_bytes = strtoull(argv[2], NULL, 10);
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
        serve(fd, reply_bytes, reply);
        close(fd);
    }
}

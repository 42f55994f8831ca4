/* What the stream echoes (pipe_echo.c, unix_echo.c) share: blocking exact reads and writes, and
 * the frame loop itself. Included as "frame_io.h", so it resolves next to the sources. */
#ifndef SCAN_BRIDGE_FRAME_IO_H
#define SCAN_BRIDGE_FRAME_IO_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

/* 1: read all n bytes; 0: end of stream first; -1: read error. */
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

/* 0: every byte of iov[0..count) written (iov is consumed); -1: write error. */
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

/* A receive buffer of at least n bytes starting on a 64-byte line. Where malloc puts it (16 bytes
 * past a page, as glibc does for every block it maps apart), a large request went through the
 * pipe into it far slower than into a line-aligned one, and an echo that slow is no floor
 * (docs/performance.md, "echo receive buffer"). */
static uint8_t *receive_buffer(size_t n) {
    return aligned_alloc(64, (n + 63) / 64 * 64);
}

/* Answer every 4-byte big-endian length-prefixed frame read from in_fd with one frame on out_fd:
 * a body of reply_bytes from `reply`, or (reply_bytes 0) the request body itself; before each
 * reply, read all must_read_bytes of `must_read` (a buffer holding no zero byte), as a server
 * that must read that much (a model's weights, say) before it can answer would.
 * 0: the peer closed between frames; 1: read/write error or a truncated frame; 2: out of memory. */
static int echo_frames(int in_fd, int out_fd, size_t reply_bytes, const uint8_t *reply, const uint8_t *must_read,
                       size_t must_read_bytes) {
    size_t cap = 1 << 20;
    uint8_t *body = receive_buffer(cap);
    if (!body) return 2;
    int status;
    for (;;) {
        uint8_t header[4];
        int r = read_exact(in_fd, header, 4);
        if (r <= 0) {
            status = r < 0 ? 1 : 0;
            break;
        }
        size_t len = ((size_t)header[0] << 24) | ((size_t)header[1] << 16) |
                     ((size_t)header[2] << 8) | (size_t)header[3];
        if (len > cap) {
            free(body);
            cap = len;
            body = receive_buffer(cap);
            if (!body) return 2;
        }
        if (read_exact(in_fd, body, len) <= 0) {
            status = 1;
            break;
        }
        /* libc's memchr reads at the machine's full vector width; finding nothing, it reads every byte */
        if (must_read_bytes && memchr(must_read, 0, must_read_bytes) != NULL) {
            status = 1;
            break;
        }
        size_t out_len = reply_bytes ? reply_bytes : len;
        uint8_t out_header[4] = {(uint8_t)(out_len >> 24), (uint8_t)(out_len >> 16),
                                 (uint8_t)(out_len >> 8), (uint8_t)out_len};
        struct iovec iov[2] = {{out_header, 4}, {reply_bytes ? (void *)reply : body, out_len}};
        if (write_all(out_fd, iov, 2) < 0) {
            status = 1;
            break;
        }
    }
    free(body);
    return status;
}

#endif

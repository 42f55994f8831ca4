/* The physical floor for the ZeroMQ lane: a ROUTER socket that answers every message with the
 * sender's envelope and frames of fixed sizes, sent without copies from one buffer. No
 * decoding, no compute: the cost of moving the same bytes through the same kind of socket.
 * Prints the endpoint it bound on stdout once ready.
 *
 *   zmq_echo ENDPOINT [SIZE...]    reply frame sizes in bytes (none: echo the message back)
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>
#ifdef __linux__
#include <signal.h>
#include <sys/prctl.h>
#endif

#define MAX_FRAMES 64

int main(int argc, char **argv) {
    if (argc < 2 || argc - 2 > MAX_FRAMES) {
        fprintf(stderr, "usage: zmq_echo ENDPOINT [SIZE...] (at most %d sizes)\n", MAX_FRAMES);
        return 2;
    }
#ifdef __linux__
    /* A bench killed before it can stop this one (SIGTERM, SIGKILL) takes it along instead of
     * leaving it running, re-parented; pipe_echo ends with its stdin. */
    prctl(PR_SET_PDEATHSIG, SIGTERM);
#endif
    int n_sizes = argc - 2;
    size_t sizes[MAX_FRAMES], largest = 0;
    for (int i = 0; i < n_sizes; i++) {
        sizes[i] = strtoull(argv[i + 2], NULL, 10);
        if (sizes[i] > largest) largest = sizes[i];
    }
    char *reply = malloc(largest ? largest : 1);
    /* Written once so that it is backed by real pages: untouched calloc memory maps every page
     * to the kernel's one zero page, which stays in cache and makes the floor too cheap. */
    if (reply) memset(reply, 0xA5, largest ? largest : 1);
    void *context = zmq_ctx_new();
    void *socket = zmq_socket(context, ZMQ_ROUTER);
    int unlimited = 0;
    zmq_setsockopt(socket, ZMQ_SNDHWM, &unlimited, sizeof unlimited);
    zmq_setsockopt(socket, ZMQ_RCVHWM, &unlimited, sizeof unlimited);
    if (!reply || zmq_bind(socket, argv[1]) != 0) {
        fprintf(stderr, "zmq_echo: bind %s: %s\n", argv[1], zmq_strerror(zmq_errno()));
        return 1;
    }
    char bound[256];
    size_t bound_size = sizeof bound;
    zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, bound, &bound_size);
    printf("%s\n", bound);  /* ready, and where (tcp://127.0.0.1:* picks the port) */
    fflush(stdout);
    zmq_msg_t frames[MAX_FRAMES + 2];
    for (;;) {
        int count = 0, more = 1;
        while (more) {
            if (count == MAX_FRAMES + 2) {
                fprintf(stderr, "zmq_echo: a message of more than %d frames\n", MAX_FRAMES + 2);
                return 1;
            }
            zmq_msg_init(&frames[count]);
            if (zmq_msg_recv(&frames[count], socket, 0) < 0) {
                if (zmq_errno() == EINTR) continue;
                return 1;
            }
            more = zmq_msg_more(&frames[count]);
            count++;
        }
        if (n_sizes == 0) {  /* echo: the envelope and every frame as they came */
            for (int i = 0; i < count; i++)
                zmq_msg_send(&frames[i], socket, i + 1 < count ? ZMQ_SNDMORE : 0);
            continue;
        }
        /* The envelope (routing id, and a REQ peer's empty delimiter) goes back as it came. */
        int envelope = count >= 3 && zmq_msg_size(&frames[1]) == 0 ? 2 : 1;
        for (int i = 0; i < envelope; i++) zmq_msg_send(&frames[i], socket, ZMQ_SNDMORE);
        for (int i = envelope; i < count; i++) zmq_msg_close(&frames[i]);
        for (int i = 0; i < n_sizes; i++) {
            zmq_msg_t out;
            zmq_msg_init_data(&out, reply, sizes[i], NULL, NULL);
            zmq_msg_send(&out, socket, i + 1 < n_sizes ? ZMQ_SNDMORE : 0);
        }
    }
}

/* A one-shot storm in C: the receiver benchmark's cheap client (bench_receiver.py builds it).
 *
 * Sends COPIES copies of one HTTP request (REQUEST_FILE, sent as is) to 127.0.0.1:PORT at once
 * and times each answer. The point of C is that the client costs almost nothing (a write and a
 * read per copy, epoll), so what is measured is the server: a Python client on the same two
 * cores spends about as much CPU per copy as the server does.
 *
 * Two ways to arrive, as Alertmanager's copies can:
 *   default: on keep-alive connections opened first (connects, then waits for the server to
 *            accept them: SETTLE_MS, or with -g until a line is read on stdin after "ready" is
 *            printed on stderr), then every request written as fast as the loop goes; a latency
 *            runs from its request's write to the last byte of its answer;
 *   -n:      on new connections, all connects started at once; a latency runs from its connect
 *            to the last byte of its answer (handshake, accept and request included).
 *
 * Output, one line per copy, in the order they were sent: "STATUS LATENCY_US START", START being
 * the answer's first "start" field ("-" when none); "0 -1 -" for a copy with no complete answer
 * within TIMEOUT_MS or whose connection failed.
 *
 * usage: storm [-c COPIES] [-t TIMEOUT_MS] [-s SETTLE_MS | -g] [-n] PORT REQUEST_FILE
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BUF 8192

struct copy {
    int fd, sent;
    long start_ns, done_ns;           /* done_ns: 0 pending, -1 failed */
    int status, length, have, head;   /* head: header bytes, 0 until the blank line is seen */
    char buf[BUF];
};

static char request[65536];
static size_t request_len;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static int parse_head(struct copy *c) {
    char *end = memmem(c->buf, c->have, "\r\n\r\n", 4);
    if (!end) return 0;
    c->head = (int)(end - c->buf) + 4;
    c->status = atoi(c->buf + 9);  /* "HTTP/1.1 202 ..." */
    c->length = 0;
    for (char *line = c->buf; line < end; line = strstr(line, "\r\n") + 2) {
        if (strncasecmp(line, "content-length:", 15) == 0) c->length = atoi(line + 15);
    }
    return 1;
}

static void start_field(const struct copy *c, char *out, size_t size) {
    const char *key = memmem(c->buf + c->head, c->have - c->head, "\"start\"", 7);
    snprintf(out, size, "-");
    if (!key) return;
    const char *open = memchr(key + 7, '"', c->buf + c->have - (key + 7));
    if (!open) return;
    const char *close = memchr(open + 1, '"', c->buf + c->have - (open + 1));
    if (!close || (size_t)(close - open) >= size) return;
    snprintf(out, size, "%.*s", (int)(close - open - 1), open + 1);
}

static int new_socket(const struct sockaddr_in *addr, int blocking) {
    int fd = socket(AF_INET, SOCK_STREAM | (blocking ? 0 : SOCK_NONBLOCK), 0), one = 1;
    if (fd < 0) return -1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (const struct sockaddr *)addr, sizeof *addr) != 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    if (blocking) fcntl(fd, F_SETFL, O_NONBLOCK);
    return fd;
}

static void send_request(struct copy *c) {
    if (write(c->fd, request, request_len) != (ssize_t)request_len) c->done_ns = -1;
    c->sent = 1;
}

int main(int argc, char **argv) {
    int n = 1000, fresh = 0, go_on_stdin = 0, opt;
    long timeout_ms = 30000, settle_ms = 500;
    while ((opt = getopt(argc, argv, "c:t:s:gn")) != -1) {
        switch (opt) {
            case 'c': n = atoi(optarg); break;
            case 't': timeout_ms = atol(optarg); break;
            case 's': settle_ms = atol(optarg); break;
            case 'g': go_on_stdin = 1; break;
            case 'n': fresh = 1; break;
            default: goto usage;
        }
    }
    if (argc - optind != 2 || n <= 0) goto usage;
    int port = atoi(argv[optind]);
    FILE *f = fopen(argv[optind + 1], "rb");
    if (!f) {
        fprintf(stderr, "storm: cannot read %s: %s\n", argv[optind + 1], strerror(errno));
        return 2;
    }
    request_len = fread(request, 1, sizeof request, f);
    fclose(f);

    struct copy *copies = calloc(n, sizeof *copies);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    int ep = epoll_create1(0);
    if (!fresh) {
        for (int i = 0; i < n; i++) {  /* blocking connects: the storm has not started yet */
            if ((copies[i].fd = new_socket(&addr, 1)) < 0) {
                fprintf(stderr, "storm: connection %d: %s\n", i, strerror(errno));
                return 1;
            }
            struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (unsigned)i};
            epoll_ctl(ep, EPOLL_CTL_ADD, copies[i].fd, &ev);
        }
        if (go_on_stdin) {
            char line[16];
            fprintf(stderr, "ready\n");
            fflush(stderr);
            if (!fgets(line, sizeof line, stdin)) return 1;
        } else {
            struct timespec settle = {settle_ms / 1000, (settle_ms % 1000) * 1000000L};
            nanosleep(&settle, NULL);
        }
        for (int i = 0; i < n; i++) {
            copies[i].start_ns = now_ns();
            send_request(&copies[i]);
        }
    } else {
        for (int i = 0; i < n; i++) {
            copies[i].start_ns = now_ns();
            if ((copies[i].fd = new_socket(&addr, 0)) < 0) {
                copies[i].done_ns = -1;
                continue;
            }
            struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.u32 = (unsigned)i};
            epoll_ctl(ep, EPOLL_CTL_ADD, copies[i].fd, &ev);
        }
    }

    int pending = 0;
    for (int i = 0; i < n; i++) pending += copies[i].done_ns == 0;
    long deadline = now_ns() + timeout_ms * 1000000L;
    struct epoll_event events[256];
    while (pending > 0) {
        long left_ms = (deadline - now_ns()) / 1000000L;
        if (left_ms <= 0) break;
        int ready = epoll_wait(ep, events, 256, (int)left_ms);
        long t = now_ns();
        for (int e = 0; e < ready; e++) {
            struct copy *c = &copies[events[e].data.u32];
            if (c->done_ns) continue;
            if (!c->sent) {  /* -n: connected (or refused) */
                int err = 0;
                socklen_t len = sizeof err;
                getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
                struct epoll_event ev = {.events = EPOLLIN, .data.u32 = events[e].data.u32};
                epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
                if (err) c->done_ns = -1; else send_request(c);
                if (c->done_ns) pending--;
                continue;
            }
            ssize_t got = read(c->fd, c->buf + c->have, BUF - 1 - c->have);
            if (got <= 0) {
                if (got < 0 && errno == EAGAIN) continue;
                c->done_ns = -1;  /* closed or failed before a full answer */
                pending--;
                continue;
            }
            c->have += (int)got;
            if (!c->head && !parse_head(c)) continue;
            if (c->have >= c->head + c->length || c->have >= BUF - 1) {
                c->done_ns = t;
                pending--;
            }
        }
    }
    for (int i = 0; i < n; i++) {
        char start[64];
        if (copies[i].done_ns > 0) {
            start_field(&copies[i], start, sizeof start);
            printf("%d %ld %s\n", copies[i].status, (copies[i].done_ns - copies[i].start_ns) / 1000, start);
        } else {
            printf("0 -1 -\n");
        }
        if (copies[i].fd > 0) close(copies[i].fd);
    }
    return 0;

usage:
    fprintf(stderr, "usage: %s [-c COPIES] [-t TIMEOUT_MS] [-s SETTLE_MS | -g] [-n] PORT REQUEST_FILE\n", argv[0]);
    return 2;
}

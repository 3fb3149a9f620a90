/*
 * Experiment aid, not part of kvroute: an LD_PRELOAD shim that turns on
 * TCP_NODELAY for every socket a process accepts. kvroute-router and
 * kvroute-sim serve with axum::serve, which leaves Nagle's algorithm on, so a
 * small streamed chunk can wait for the client's delayed ACK (~40 ms on
 * Linux). Running a benchmark under this shim shows what setting TCP_NODELAY
 * on accepted connections would buy, without changing the binaries.
 *
 *   gcc -shared -fPIC -O2 -o /tmp/nodelay.so bench/tools/nodelay.c -ldl
 *   LD_PRELOAD=/tmp/nodelay.so cargo run --release -p kvroute-bench -- compare ...
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

static void nodelay(int fd) {
    int one = 1;
    if (fd >= 0) {
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* fails harmlessly on non-TCP sockets */
    }
}

int accept(int s, struct sockaddr *addr, socklen_t *len) {
    static int (*real)(int, struct sockaddr *, socklen_t *);
    if (!real) real = dlsym(RTLD_NEXT, "accept");
    int fd = real(s, addr, len);
    nodelay(fd);
    return fd;
}

int accept4(int s, struct sockaddr *addr, socklen_t *len, int flags) {
    static int (*real)(int, struct sockaddr *, socklen_t *, int);
    if (!real) real = dlsym(RTLD_NEXT, "accept4");
    int fd = real(s, addr, len, flags);
    nodelay(fd);
    return fd;
}

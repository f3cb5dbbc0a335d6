/*
 * The machine's floor for relaying a stream: what bench_proxy.py's "floor C" path runs.
 *
 * A single-threaded epoll relay on loopback: each accepted client gets one connection
 * to the upstream port, and every read on either side is written straight to the
 * other; nothing is parsed or buffered. Its CPU time per relayed chunk is what the
 * kernel charges for one wake-up, one read and one write here, which no relay, in any
 * language, gets below.
 *
 *     cc -O2 -o floor_relay scripts/floor_relay.c && ./floor_relay PORT UPSTREAM_PORT
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_FD 65536

static int peer[MAX_FD];

static struct sockaddr_in loopback(int port) {
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return addr;
}

static void watch(int epoll, int fd) {
    struct epoll_event event = {.events = EPOLLIN, .data.fd = fd};
    epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &event);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PORT UPSTREAM_PORT\n", argv[0]);
        return 2;
    }
    struct sockaddr_in here = loopback(atoi(argv[1])), upstream = loopback(atoi(argv[2]));
    int one = 1, listener = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(listener, (struct sockaddr *)&here, sizeof here) || listen(listener, 256)) {
        perror("floor_relay: listen");
        return 1;
    }
    int epoll = epoll_create1(0);
    watch(epoll, listener);
    static char buffer[65536];
    struct epoll_event events[64];
    for (;;) {
        int n = epoll_wait(epoll, events, 64, -1);
        for (int i = 0; i < n; i++) {
            int fd = events[i].data.fd;
            if (fd == listener) {
                int client = accept(listener, NULL, NULL), server = socket(AF_INET, SOCK_STREAM, 0);
                if (client < 0 || server < 0 || client >= MAX_FD || server >= MAX_FD ||
                    connect(server, (struct sockaddr *)&upstream, sizeof upstream)) {
                    if (client >= 0) close(client);
                    if (server >= 0) close(server);
                    continue;
                }
                setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                peer[client] = server;
                peer[server] = client;
                watch(epoll, client);
                watch(epoll, server);
                continue;
            }
            ssize_t got = read(fd, buffer, sizeof buffer);
            if (got <= 0 || write(peer[fd], buffer, (size_t)got) != got) {
                close(peer[fd]); /* closing drops both from the epoll set */
                close(fd);
            }
        }
    }
}

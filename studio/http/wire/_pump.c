/* The relay's chunk pump: a chunked llama-server body passed on to the client's connection by one C thread.

Per relayed chunk the Python relay (studio.http.wire.upstream_wire.Framed) costs an event loop wake, a
callback and a write; the same wake, read and write in C cost about two thirds of that
(scripts/bench_proxy.py's "floor C"), and no Python runs. Once a stream's head and first bytes
went on in Python, its two connections (duplicated, so that the event loop keeps its own) are
handed to this thread, which reads each arrival, checks its chunked framing, writes it on as it
came and, once the body ends, hands the arrival that ended it back (for the caller to write with
its own end) with how it ended, over an eventfd the event loop reads.

A client that reads slower than the model writes: the rest of the arrival waits here and the
upstream is not read until the client took it. A client that is gone (its connection hung up, a
write failed) ends the stream here; the event loop notices it too and cancels the relay.

Linux only (epoll, eventfd): elsewhere the extension is not built and the relay stays in Python.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifndef __linux__
#error "the chunk pump uses epoll and eventfd: Linux only (elsewhere the relay stays in Python)"
#endif

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define READ_SIZE 65536

/* How a stream ended; results() reports it by name (HOW). */
enum { R_COMPLETE, R_BROKEN, R_GARBLED, R_CLIENT_GONE };
static const char *const HOW[] = {"complete", "broken", "garbled", "client gone"};

/* Chunked framing (RFC 9112 7.1), one state per place a byte can be in. */
enum {
    S_SIZE,        /* a chunk's size line: hex digits */
    S_EXT,         /* after the size: extensions or whitespace, up to CR */
    S_SIZE_LF,     /* the size line's LF */
    S_DATA,        /* the chunk's bytes */
    S_DATA_CR,     /* the CR after them */
    S_DATA_LF,     /* the LF after them */
    S_TRAILER_BOL, /* after the last chunk: a trailer line, or the CR of the end */
    S_TRAILER,     /* inside a trailer line */
    S_TRAILER_LF,  /* a trailer line's LF */
    S_END_LF,      /* the body's final LF */
};

/* Where the framing is: the state, and the chunk size read so far (its digits) or left to read. */
typedef struct {
    int state, digits;
    uint64_t size;
} Framing;

typedef struct Channel Channel;

typedef struct Result {
    struct Result *next;
    uint64_t id;
    int kind, err, between;
    double first_at;
    char *data, *before, *last;
    size_t data_len, before_len, last_len;
} Result;

typedef struct Stream {
    struct Stream *next;
    uint64_t id;
    Channel *chan;
    int up, client;
    Framing framing; /* after what was written */
    char *pending;
    size_t pending_len, pending_off;
    char *before, *last;
    size_t before_len, last_len;
    double first_at;
} Stream;

struct Channel {
    int efd;
    Result *results, *results_tail;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int epfd = -1;
static pid_t epfd_pid = 0; /* the process whose thread serves epfd: a forked child starts its own */
static Stream *streams = NULL;
static uint64_t next_id = 1;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.perf_counter's clock on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static Stream *find(uint64_t id) {
    for (Stream *s = streams; s != NULL; s = s->next)
        if (s->id == id) return s;
    return NULL;
}

/* Whether what was written ends between two chunks (an error event can follow), not inside one. */
static int between(const Stream *s) { return s->framing.state == S_SIZE && s->framing.digits == 0; }

/* Register (EPOLL_CTL_ADD) or change (EPOLL_CTL_MOD) what wakes the thread for the stream's two connections;
   -1 (errno set) on failure. The client's hang-up and errors wake it whatever its events. */
static int watch(Stream *s, int op, uint32_t up_events, uint32_t client_events) {
    struct epoll_event up = {.events = up_events, .data.u64 = s->id << 1};
    struct epoll_event client = {.events = client_events, .data.u64 = (s->id << 1) | 1};
    if (epoll_ctl(epfd, op, s->client, &client) < 0) return -1;
    return epoll_ctl(epfd, op, s->up, &up);
}

static void unlink_stream(Stream *gone) {
    for (Stream **at = &streams; *at != NULL; at = &(*at)->next)
        if (*at == gone) {
            *at = gone->next;
            return;
        }
}

/* Unregister and close a stream's connections (the event loop's own stay open) and free it; under the lock. */
static void drop(Stream *s) {
    unlink_stream(s);
    epoll_ctl(epfd, EPOLL_CTL_DEL, s->up, NULL); /* explicitly: the loop's descriptors keep the sockets open */
    epoll_ctl(epfd, EPOLL_CTL_DEL, s->client, NULL);
    close(s->up);
    close(s->client);
    free(s->pending);
    free(s->before);
    free(s->last);
    free(s);
}

/* Keep [data, data + len) as the last arrival, the one before it as the one before; 0 when out of memory. */
static int remember(Stream *s, const char *data, size_t len) {
    char *copy = malloc(len ? len : 1);
    if (copy == NULL) return 0;
    memcpy(copy, data, len);
    free(s->before);
    s->before = s->last;
    s->before_len = s->last_len;
    s->last = copy;
    s->last_len = len;
    return 1;
}

/* End the stream: its result to its channel (the tail handed over), the event loop woken; under the lock. */
static void finish(Stream *s, int kind, int err, const char *data, size_t len) {
    Channel *chan = s->chan;
    Result *r = calloc(1, sizeof(Result));
    if (r != NULL) {
        r->id = s->id;
        r->kind = kind;
        r->err = err;
        r->between = between(s);
        r->first_at = s->first_at;
        if (len) {
            r->data = malloc(len);
            if (r->data != NULL) {
                memcpy(r->data, data, len);
                r->data_len = len;
            }
        }
        r->before = s->before;
        r->before_len = s->before_len;
        r->last = s->last;
        r->last_len = s->last_len;
        s->before = s->last = NULL;
        if (chan->results_tail != NULL)
            chan->results_tail->next = r;
        else
            chan->results = r;
        chan->results_tail = r;
    }
    drop(s);
    uint64_t one = 1;
    ssize_t ignored = write(chan->efd, &one, sizeof one);
    (void)ignored;
}

static int hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Step the framing f over [data, data + len): the offset just past the body's end, 0 if it does not end in
   it, -1 if the framing is broken; *payload says whether any chunk bytes were in it. */
static ssize_t frame(Framing *f, const char *data, size_t len, int *payload) {
    size_t i = 0;
    while (i < len) {
        char c = data[i];
        switch (f->state) {
        case S_SIZE: {
            int d = hex(c);
            if (d >= 0) {
                if (++f->digits > 15) return -1;
                f->size = f->size * 16 + (uint64_t)d;
            } else if (f->digits == 0) {
                return -1;
            } else if (c == '\r') {
                f->state = S_SIZE_LF;
            } else if (c == ';' || c == ' ' || c == '\t') {
                f->state = S_EXT;
            } else {
                return -1;
            }
            i++;
            break;
        }
        case S_EXT:
            if (c == '\n') return -1;
            if (c == '\r') f->state = S_SIZE_LF;
            i++;
            break;
        case S_SIZE_LF:
            if (c != '\n') return -1;
            f->state = f->size == 0 ? S_TRAILER_BOL : S_DATA;
            i++;
            break;
        case S_DATA: {
            size_t take = len - i;
            if ((uint64_t)take > f->size) take = (size_t)f->size;
            f->size -= take;
            i += take;
            *payload = 1;
            if (f->size == 0) f->state = S_DATA_CR;
            break;
        }
        case S_DATA_CR:
            if (c != '\r') return -1;
            f->state = S_DATA_LF;
            i++;
            break;
        case S_DATA_LF:
            if (c != '\n') return -1;
            f->state = S_SIZE;
            f->digits = 0;
            f->size = 0;
            i++;
            break;
        case S_TRAILER_BOL:
            f->state = c == '\r' ? S_END_LF : S_TRAILER;
            i++;
            break;
        case S_TRAILER:
            if (c == '\r') f->state = S_TRAILER_LF;
            i++;
            break;
        case S_TRAILER_LF:
            if (c != '\n') return -1;
            f->state = S_TRAILER_BOL;
            i++;
            break;
        case S_END_LF:
            if (c != '\n') return -1;
            return (ssize_t)(i + 1);
        }
    }
    return 0;
}

/* Write what is pending to the client: 1 all of it, 0 some is left (the client is behind), -errno on failure. */
static int flush(Stream *s) {
    while (s->pending_off < s->pending_len) {
        ssize_t n = send(s->client, s->pending + s->pending_off, s->pending_len - s->pending_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            return -errno;
        }
        s->pending_off += (size_t)n;
    }
    free(s->pending);
    s->pending = NULL;
    s->pending_len = s->pending_off = 0;
    return 1;
}

static void on_upstream(Stream *s, char *buf) {
    ssize_t n = recv(s->up, buf, READ_SIZE, MSG_DONTWAIT); /* whether or not the socket blocks: never here */
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        finish(s, R_BROKEN, errno, NULL, 0);
        return;
    }
    if (n == 0) {
        finish(s, R_BROKEN, 0, NULL, 0);
        return;
    }
    if (s->first_at == 0.0) s->first_at = now();
    Framing after = s->framing; /* stepped on a copy: a broken arrival is not written, nor framed */
    int payload = 0;
    ssize_t end = frame(&after, buf, (size_t)n, &payload);
    if (end < 0) {
        finish(s, R_GARBLED, 0, NULL, 0);
        return;
    }
    s->framing = after;
    if (end > 0) { /* the body's end: the caller writes it with its own */
        if (payload && !remember(s, buf, (size_t)end)) {
            finish(s, R_BROKEN, ENOMEM, NULL, 0);
            return;
        }
        finish(s, R_COMPLETE, 0, buf, (size_t)end);
        return;
    }
    if (!remember(s, buf, (size_t)n)) {
        finish(s, R_BROKEN, ENOMEM, NULL, 0);
        return;
    }
    ssize_t w;
    do
        w = send(s->client, buf, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (w < 0 && errno == EINTR);
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        finish(s, R_CLIENT_GONE, errno, NULL, 0);
        return;
    }
    if (w < 0) w = 0;
    if (w < n) {
        s->pending_len = (size_t)(n - w);
        s->pending = malloc(s->pending_len);
        if (s->pending == NULL) {
            finish(s, R_CLIENT_GONE, ENOMEM, NULL, 0);
            return;
        }
        memcpy(s->pending, buf + w, s->pending_len);
        s->pending_off = 0;
        watch(s, EPOLL_CTL_MOD, 0, EPOLLOUT); /* the upstream is not read until the client took the rest */
    }
}

static void on_client(Stream *s, uint32_t events) {
    if (s->pending != NULL && (events & EPOLLOUT)) {
        int flushed = flush(s);
        if (flushed < 0) {
            finish(s, R_CLIENT_GONE, -flushed, NULL, 0);
            return;
        }
        if (flushed > 0) watch(s, EPOLL_CTL_MOD, EPOLLIN, 0);
        return;
    }
    if (events & (EPOLLHUP | EPOLLERR)) finish(s, R_CLIENT_GONE, 0, NULL, 0);
}

static void *serve(void *unused) {
    (void)unused;
    static char buf[READ_SIZE];
    struct epoll_event events[64];
    int fd = epfd;
    for (;;) {
        int n = epoll_wait(fd, events, 64, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            return NULL;
        }
        pthread_mutex_lock(&lock);
        for (int i = 0; i < n; i++) {
            Stream *s = find(events[i].data.u64 >> 1); /* none: cancelled or ended since */
            if (s == NULL) continue;
            if (events[i].data.u64 & 1)
                on_client(s, events[i].events);
            else
                on_upstream(s, buf);
        }
        pthread_mutex_unlock(&lock);
    }
}

/* The thread, started once per process; under the lock. */
static int started(void) {
    if (epfd >= 0 && epfd_pid == getpid()) return 1;
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0) return 0;
    streams = NULL; /* a forked child's copy of its parent's: not its own */
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* signals stay the main thread's */
    int failed = pthread_create(&thread, &attr, serve, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (failed) {
        close(epfd);
        epfd = -1;
        return 0;
    }
    epfd_pid = getpid();
    return 1;
}

/* -- Python's side ------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD Channel chan;
} PumpObject;

static PyObject *Pump_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Pump() takes no arguments");
        return NULL;
    }
    PumpObject *self = (PumpObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->chan.efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->chan.efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    pthread_mutex_lock(&lock);
    int ok = started();
    pthread_mutex_unlock(&lock);
    if (!ok) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void free_result(Result *r) {
    free(r->data);
    free(r->before);
    free(r->last);
    free(r);
}

static void Pump_dealloc(PumpObject *self) {
    pthread_mutex_lock(&lock);
    Stream *s = streams;
    while (s != NULL) {
        Stream *next = s->next;
        if (s->chan == &self->chan) drop(s);
        s = next;
    }
    Result *r = self->chan.results;
    self->chan.results = self->chan.results_tail = NULL;
    pthread_mutex_unlock(&lock);
    while (r != NULL) {
        Result *next = r->next;
        free_result(r);
        r = next;
    }
    if (self->chan.efd >= 0) close(self->chan.efd);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Pump_fileno(PumpObject *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromLong(self->chan.efd);
}

static PyObject *Pump_add(PumpObject *self, PyObject *args) {
    int up_fd, client_fd;
    double first_at;
    const char *last;
    Py_ssize_t last_len;
    if (!PyArg_ParseTuple(args, "iidy#", &up_fd, &client_fd, &first_at, &last, &last_len)) return NULL;
    Stream *s = calloc(1, sizeof(Stream));
    if (s == NULL) return PyErr_NoMemory();
    s->chan = &self->chan;
    s->first_at = first_at;
    s->framing.state = S_SIZE;
    s->up = fcntl(up_fd, F_DUPFD_CLOEXEC, 0);
    s->client = s->up < 0 ? -1 : fcntl(client_fd, F_DUPFD_CLOEXEC, 0);
    if (s->client < 0 || (last_len && !remember(s, last, (size_t)last_len))) {
        PyErr_SetFromErrno(PyExc_OSError);
        if (s->up >= 0) close(s->up);
        if (s->client >= 0) close(s->client);
        free(s->last);
        free(s);
        return NULL;
    }
    pthread_mutex_lock(&lock);
    s->id = next_id++;
    int failed = watch(s, EPOLL_CTL_ADD, EPOLLIN, 0) < 0; /* the client: its hang-up only, until it is behind */
    int err = errno;
    if (!failed) {
        s->next = streams;
        streams = s;
    }
    uint64_t id = s->id;
    if (failed) {
        epoll_ctl(epfd, EPOLL_CTL_DEL, s->client, NULL);
        close(s->up);
        close(s->client);
        free(s->last);
        free(s);
    }
    pthread_mutex_unlock(&lock);
    if (failed) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(id);
}

static PyObject *Pump_cancel(PumpObject *self, PyObject *arg) {
    uint64_t id = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    pthread_mutex_lock(&lock);
    Stream *s = find(id);
    int running = s != NULL && s->chan == &self->chan;
    if (running) drop(s);
    pthread_mutex_unlock(&lock);
    return PyBool_FromLong(running);
}

static PyObject *bytes_of(const char *data, size_t len) {
    return PyBytes_FromStringAndSize(len ? data : "", (Py_ssize_t)len);
}

static PyObject *Pump_results(PumpObject *self, PyObject *unused) {
    (void)unused;
    uint64_t count;
    ssize_t ignored = read(self->chan.efd, &count, sizeof count);
    (void)ignored;
    pthread_mutex_lock(&lock);
    Result *r = self->chan.results;
    self->chan.results = self->chan.results_tail = NULL;
    pthread_mutex_unlock(&lock);
    PyObject *list = PyList_New(0);
    while (r != NULL) {
        Result *next = r->next;
        if (list != NULL) {
            PyObject *item = Py_BuildValue("(KsiidNNN)", (unsigned long long)r->id, HOW[r->kind], r->err, r->between,
                                           r->first_at, bytes_of(r->data, r->data_len),
                                           bytes_of(r->before, r->before_len), bytes_of(r->last, r->last_len));
            if (item == NULL || PyList_Append(list, item) < 0) Py_CLEAR(list);
            Py_XDECREF(item);
        }
        free_result(r);
        r = next;
    }
    return list;
}

static PyMethodDef Pump_methods[] = {
    {"fileno", (PyCFunction)Pump_fileno, METH_NOARGS, "The eventfd that is readable while results wait."},
    {"add", (PyCFunction)Pump_add, METH_VARARGS,
     "add(upstream_fd, client_fd, first_at, last) -> id: pump a chunked body, at a chunk boundary, from now on."},
    {"cancel", (PyCFunction)Pump_cancel, METH_O, "cancel(id) -> bool: stop a stream; whether it was still running."},
    {"results", (PyCFunction)Pump_results, METH_NOARGS,
     "results() -> [(id, how, errno, between_chunks, first_at, end, before, last)] of the streams that ended."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PumpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "studio.http.wire._pump.Pump",
    .tp_basicsize = sizeof(PumpObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Chunked bodies pumped from llama-server to clients by one C thread; results over an eventfd.",
    .tp_new = Pump_new,
    .tp_dealloc = (destructor)Pump_dealloc,
    .tp_methods = Pump_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pump", "The relay's chunk pump (Linux): see studio.http.pump.", -1, NULL,
};

PyMODINIT_FUNC PyInit__pump(void) {
    if (PyType_Ready(&PumpType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PumpType);
    if (PyModule_AddObject(m, "Pump", (PyObject *)&PumpType) < 0) {
        Py_DECREF(&PumpType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* pd-vmagent: PID 1 of a PillDrops microVM guest (exec'd by the initramfs after switch_root) and the guest
 * end of the agent channel, a virtio-serial port named "pd.agent".
 *
 * It starts pd-init (the same static supervisor crun sandboxes run, runtime/init/pd-init.c) as its child in
 * the cgroup /sys/fs/cgroup/pd (pids.max and memory.max set from the host), restarts it if it dies, reaps every orphan, and
 * relays the host's command connections to pd-init's socket /.pd/run/ctl: the exec semantics (streamed
 * stdout/stderr, exit codes, killing a command's process group on kill or disconnect) are pd-init's, byte
 * for byte. The host speaks pd-init's own protocol inside each channel.
 *
 * Port framing, both ways:  u8 type | u32 chan | u32 len | payload   (little endian, len <= MAXPAY)
 * except type 0x00, a one-byte no-op (the host sends MAXPAY+HDR of them before a sync, which completes
 * any frame a previous host connection left half-sent).
 *
 *   host -> guest  'S' sync (payload: nonce)  -> all channels reset, reply 'S' with the same nonce
 *                  'H' identity: "key=value\n" lines (hostname, machine_id, seed (hex), time_ns, pids_max,
 *                                memory_max: the limits of the cgroup pd-init and every command run in)
 *                                -> reply "ok pids.max=N memory.max=N pids.current=N pids.refused=N" (read
 *                                back from the cgroup; an empty 'H' is a query: it changes nothing)
 *                                (hostname: the UTS name only, as crun sets it; machine_id: /.pd/machine-id)
 *                                -> applied, reply 'H' "ok" (only once pd-init listens) or "error: ..."
 *                  'O' open chan (connect to pd-init)   'D' data   'E' eof (shutdown write side)
 *                  'A' ack: u32 bytes the host consumed (credit)    'C' close chan (abort)
 *   guest -> host  'S' 'H' replies   'D' data   'A' ack: u32 bytes written to pd-init   'C' chan closed
 *
 * Flow control is by credit: each side has at most WINDOW unacknowledged bytes in flight per channel, so
 * every buffer here is bounded and one stalled command never blocks the others. When the host end of the
 * port is closed (the node agent died or is reconnecting) every channel is closed, which makes pd-init kill
 * the commands, exactly as a dropped unix connection does in a crun sandbox.
 * Built statically (gcc -static -Os) so it needs nothing from the template's root filesystem.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#define PORT_NAME "pd.agent"
#define CTL "/.pd/run/ctl"
#define PD_INIT "/.pd/bin/pd-init"
#define CGROUP "/sys/fs/cgroup/pd"
#define MACHINE_ID "/.pd/machine-id"         /* tmpfs, bind-mounted on /etc/machine-id by the initramfs */
#define NCH 64
#define MAXPAY 16384
#define HDR 9
#define WINDOW 65536
#define OUTQ (256 * 1024)
#define RESERVE 4096                      /* outq room kept for control frames */

struct ch {
    int used, fd, eof_pending, wr_dead;
    uint32_t id, credit, ack_pending;
    unsigned char *buf;                   /* host -> pd-init bytes not yet written, [off, len) */
    uint32_t off, len;
};

static struct ch chans[NCH];
static unsigned char inq[MAXPAY + HDR], outq[OUTQ];
static uint32_t in_len, out_off, out_len;
static int port = -1;
static pid_t init_pid = -1;
static long long init_restart_at = 0;

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static void put_u32(unsigned char *p, uint32_t v) { p[0] = v; p[1] = v >> 8; p[2] = v >> 16; p[3] = v >> 24; }
static uint32_t get_u32(const unsigned char *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

static uint32_t room(void) { return OUTQ - out_len; }

static void emit(int type, uint32_t chan, const void *p, uint32_t n) {
    if (room() < HDR + n) return;                    /* callers check; never overflow */
    unsigned char *h = outq + out_len;
    h[0] = type;
    put_u32(h + 1, chan);
    put_u32(h + 5, n);
    if (n) memcpy(h + HDR, p, n);
    out_len += HDR + n;
}

static void emit_u32(int type, uint32_t chan, uint32_t v) {
    unsigned char b[4];
    put_u32(b, v);
    emit(type, chan, b, 4);
}

static void ch_close(struct ch *c) {
    if (c->fd >= 0) close(c->fd);
    free(c->buf);
    memset(c, 0, sizeof *c);
    c->fd = -1;
}

static void reset_all(void) {
    for (int i = 0; i < NCH; i++) if (chans[i].used) ch_close(&chans[i]);
    out_off = out_len = 0;
    in_len = 0;
}

static struct ch *find(uint32_t id) {
    for (int i = 0; i < NCH; i++) if (chans[i].used && chans[i].id == id) return &chans[i];
    return NULL;
}

static int write_file(const char *path, const char *s, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return -1;
    ssize_t w = write(fd, s, n);
    close(fd);
    return w == (ssize_t)n ? 0 : -1;
}

static void read_file(const char *path, char *buf, size_t n) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t r = fd >= 0 ? read(fd, buf, n - 1) : -1;
    if (fd >= 0) close(fd);
    buf[r > 0 ? r : 0] = 0;
    char *nl = strchr(buf, '\n');
    if (nl) *nl = 0;
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Apply the identity the host sends after every restore; returns the reply text. */
static const char *identity(char *p, uint32_t n) {
    static char err[160];
    char *end = p + n;
    err[0] = 0;
    while (p < end) {
        char *nl = memchr(p, '\n', end - p);
        if (!nl) break;
        *nl = 0;
        char *eq = strchr(p, '=');
        if (eq) {
            *eq = 0;
            char *k = p, *v = eq + 1;
            size_t vl = strlen(v);
            if (!strcmp(k, "hostname")) {
                if (vl == 0 || vl > 63 || sethostname(v, vl) != 0) snprintf(err, sizeof err, "error: hostname");
            } else if (!strcmp(k, "machine_id")) {
                char line[40];
                if (vl != 32) { snprintf(err, sizeof err, "error: machine_id"); }
                else {
                    snprintf(line, sizeof line, "%s\n", v);
                    if (write_file(MACHINE_ID, line, 33) != 0)
                        snprintf(err, sizeof err, "error: machine-id: %s", strerror(errno));
                }
            } else if (!strcmp(k, "seed")) {
                struct { struct rand_pool_info info; unsigned char b[64]; } rp;
                size_t nb = vl / 2;
                if (nb == 0 || nb > sizeof rp.b) { snprintf(err, sizeof err, "error: seed"); }
                else {
                    for (size_t i = 0; i < nb; i++) {
                        int hi = hexval(v[2 * i]), lo = hexval(v[2 * i + 1]);
                        rp.b[i] = (hi < 0 || lo < 0) ? 0 : (unsigned char)(hi << 4 | lo);
                    }
                    rp.info.entropy_count = nb * 8;
                    rp.info.buf_size = nb;
                    int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
                    if (fd < 0 || ioctl(fd, RNDADDENTROPY, &rp) != 0 || ioctl(fd, RNDRESEEDCRNG) != 0)
                        snprintf(err, sizeof err, "error: reseed: %s", strerror(errno));
                    if (fd >= 0) close(fd);
                }
            } else if (!strcmp(k, "time_ns")) {
                long long t = atoll(v);
                struct timespec ts = {.tv_sec = t / 1000000000LL, .tv_nsec = t % 1000000000LL};
                if (t <= 0 || clock_settime(CLOCK_REALTIME, &ts) != 0) snprintf(err, sizeof err, "error: time");
            } else if (!strcmp(k, "pids_max")) {
                if (write_file(CGROUP "/pids.max", v, vl) != 0)
                    snprintf(err, sizeof err, "error: pids.max: %s", strerror(errno));
            } else if (!strcmp(k, "memory_max")) {
                if (write_file(CGROUP "/memory.max", v, vl) != 0)
                    snprintf(err, sizeof err, "error: memory.max: %s", strerror(errno));
            }
        }
        p = nl + 1;
    }
    if (err[0]) return err;
    struct stat st;
    if (lstat(CTL, &st) != 0 || !S_ISSOCK(st.st_mode)) return "error: pd-init is not listening yet";
    /* "ok" + the limits as the guest's cgroup has them now (read back, not echoed), its process count and
     * the forks it refused at the limit (pids.events "max N") */
    static char ok[256];
    char pids[32] = "", mem[32] = "", cur[32] = "", ev[64] = "";
    read_file(CGROUP "/pids.max", pids, sizeof pids);
    read_file(CGROUP "/memory.max", mem, sizeof mem);
    read_file(CGROUP "/pids.current", cur, sizeof cur);
    read_file(CGROUP "/pids.events", ev, sizeof ev);
    snprintf(ok, sizeof ok, "ok pids.max=%s memory.max=%s pids.current=%s pids.refused=%s", pids, mem, cur,
             strncmp(ev, "max ", 4) == 0 ? ev + 4 : "0");
    return ok;
}

static void on_frame(int type, uint32_t id, unsigned char *p, uint32_t n) {
    struct ch *c = find(id);
    switch (type) {
    case 'S':
        reset_all();
        emit('S', id, p, n > 64 ? 64 : n);
        break;
    case 'H': {
        const char *r = identity((char *)p, n);
        emit('H', id, r, strlen(r));
        break;
    }
    case 'O': {
        struct ch *f = NULL;
        for (int i = 0; i < NCH && !f; i++) if (!chans[i].used) f = &chans[i];
        int fd = -1;
        if (f && !c) {
            struct sockaddr_un a = {.sun_family = AF_UNIX};
            strcpy(a.sun_path, CTL);
            fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
            if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) != 0) { close(fd); fd = -1; }
        }
        if (fd < 0) { emit('C', id, NULL, 0); break; }
        memset(f, 0, sizeof *f);
        f->used = 1; f->fd = fd; f->id = id; f->credit = WINDOW;
        break;
    }
    case 'D':
        if (!c) break;
        if (c->wr_dead) { c->ack_pending += n; break; }          /* pd-init stopped reading: drop */
        if (c->len - c->off + n > WINDOW) { ch_close(c); emit('C', id, NULL, 0); break; }   /* credit abuse */
        if (!c->buf && !(c->buf = malloc(WINDOW))) { ch_close(c); emit('C', id, NULL, 0); break; }
        if (c->off > 0 && c->len + n > WINDOW) {
            memmove(c->buf, c->buf + c->off, c->len - c->off);
            c->len -= c->off;
            c->off = 0;
        }
        memcpy(c->buf + c->len, p, n);
        c->len += n;
        break;
    case 'E':
        if (c) c->eof_pending = 1;
        break;
    case 'A':
        if (c && n == 4) {
            uint32_t v = get_u32(p);
            c->credit = c->credit + v > WINDOW ? WINDOW : c->credit + v;
        }
        break;
    case 'C':
        if (c) ch_close(c);
        break;
    }
}

static void parse(void) {
    uint32_t pos = 0;
    while (pos < in_len) {
        if (inq[pos] == 0) { pos++; continue; }
        if (in_len - pos < HDR) break;
        uint32_t n = get_u32(inq + pos + 5);
        if (n > MAXPAY) { reset_all(); return; }                 /* not our framing: drop everything */
        if (in_len - pos < HDR + n) break;
        on_frame(inq[pos], get_u32(inq + pos + 1), inq + pos + HDR, n);
        if (in_len == 0) return;                                  /* a sync reset the queues */
        pos += HDR + n;
    }
    memmove(inq, inq + pos, in_len - pos);
    in_len -= pos;
}

static void ch_write(struct ch *c) {
    while (c->off < c->len) {
        ssize_t w = write(c->fd, c->buf + c->off, c->len - c->off);
        if (w > 0) { c->off += w; c->ack_pending += w; continue; }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno == EAGAIN) return;
        c->wr_dead = 1;                            /* pd-init closed its reading side: drop the rest */
        c->ack_pending += c->len - c->off;
        break;
    }
    c->off = c->len = 0;
    if (c->eof_pending) { shutdown(c->fd, SHUT_WR); c->eof_pending = 0; c->wr_dead = 1; }
}

static void ch_read(struct ch *c) {
    uint32_t max = room() > HDR + RESERVE ? room() - HDR - RESERVE : 0;
    if (max > MAXPAY) max = MAXPAY;
    if (max > c->credit) max = c->credit;
    if (max == 0) return;
    unsigned char *h = outq + out_len;
    ssize_t n = read(c->fd, h + HDR, max);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n <= 0) {
        uint32_t id = c->id;
        ch_close(c);
        emit('C', id, NULL, 0);
        return;
    }
    h[0] = 'D';
    put_u32(h + 1, c->id);
    put_u32(h + 5, n);
    out_len += HDR + n;
    c->credit -= n;
}

static void flush_port(void) {
    while (out_off < out_len) {
        ssize_t w = write(port, outq + out_off, out_len - out_off);
        if (w > 0) { out_off += w; continue; }
        if (w < 0 && errno == EINTR) continue;
        break;                                     /* EAGAIN, or the host end closed */
    }
    if (out_off == out_len) out_off = out_len = 0;
    else if (out_off > OUTQ / 2) {
        memmove(outq, outq + out_off, out_len - out_off);
        out_len -= out_off;
        out_off = 0;
    }
}

/* pd-init as PID 1 of its own pid namespace (with its own /proc), as in a container: commands see only the
 * sandbox's processes, not the guest kernel's threads or this agent; its death ends every command. */
static void start_init(void) {
    pid_t pid = (pid_t)syscall(SYS_clone, CLONE_NEWPID | CLONE_NEWNS | SIGCHLD, NULL, NULL, NULL, NULL);
    if (pid == 0) {
        sigset_t all;
        sigfillset(&all);
        sigprocmask(SIG_UNBLOCK, &all, NULL);
        write_file(CGROUP "/cgroup.procs", "0", 1);            /* "0": the writer itself */
        mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
        execl(PD_INIT, "pd-init", (char *)NULL);
        dprintf(2, "pd-vmagent: exec %s: %s\n", PD_INIT, strerror(errno));
        _exit(127);
    }
    init_pid = pid;
}

static int open_port(void) {
    DIR *d = opendir("/sys/class/virtio-ports");
    struct dirent *e;
    int fd = -1;
    while (d && (e = readdir(d)) && fd < 0) {
        char path[300], name[64] = "";
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", e->d_name);
        int nf = open(path, O_RDONLY | O_CLOEXEC);
        if (nf < 0) continue;
        ssize_t r = read(nf, name, sizeof name - 1);
        close(nf);
        if (r > 0 && name[r - 1] == '\n') name[r - 1] = 0;
        if (r > 0 && !strcmp(name, PORT_NAME)) {
            snprintf(path, sizeof path, "/dev/%s", e->d_name);
            fd = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
        }
    }
    if (d) closedir(d);
    return fd;
}

static void setup_guest(void) {
    mkdir("/dev/pts", 0755);
    mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5");
    mkdir("/dev/shm", 01777);
    mount("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    mount("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    write_file("/sys/fs/cgroup/cgroup.subtree_control", "+pids +memory", 13);
    mkdir(CGROUP, 0755);
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);           /* loopback up, as in a container */
    if (s >= 0) {
        struct ifreq ifr = {0};
        strcpy(ifr.ifr_name, "lo");
        if (ioctl(s, SIOCGIFFLAGS, &ifr) == 0) { ifr.ifr_flags |= IFF_UP; ioctl(s, SIOCSIFFLAGS, &ifr); }
        close(s);
    }
}

int main(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGPIPE);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigprocmask(SIG_BLOCK, &set, NULL);
    int sfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    for (int i = 0; i < NCH; i++) chans[i].fd = -1;
    setup_guest();
    start_init();
    for (int tries = 0; port < 0; tries++) {
        port = open_port();
        if (port < 0) {
            if (tries == 100) dprintf(2, "pd-vmagent: no virtio port named %s yet\n", PORT_NAME);
            usleep(20000);
        }
    }
    dprintf(2, "PD-VMAGENT-READY\n");
    struct pollfd pfd[2 + NCH];
    int owner[2 + NCH];
    for (;;) {
        int n = 0, hup_wait = 0;
        if (init_pid < 0 && now_ms() >= init_restart_at) start_init();
        for (int i = 0; i < NCH; i++) {          /* pending acks, as room allows */
            struct ch *c = &chans[i];
            if (c->used && c->ack_pending && room() >= HDR + 4) { emit_u32('A', c->id, c->ack_pending); c->ack_pending = 0; }
        }
        pfd[n] = (struct pollfd){.fd = sfd, .events = POLLIN}; owner[n++] = -1;
        short pev = 0;
        if (in_len < sizeof inq) pev |= POLLIN;
        if (out_len > out_off) pev |= POLLOUT;
        pfd[n] = (struct pollfd){.fd = port, .events = pev}; owner[n++] = -2;
        for (int i = 0; i < NCH; i++) {
            struct ch *c = &chans[i];
            if (!c->used) continue;
            short ev = 0;
            if (c->credit > 0 && room() > HDR + RESERVE + 1024) ev |= POLLIN;
            if (c->len > c->off || c->eof_pending) ev |= POLLOUT;
            if (ev) { pfd[n] = (struct pollfd){.fd = c->fd, .events = ev}; owner[n++] = i; }
        }
        int timeout = init_pid < 0 ? 100 : -1;
        if (poll(pfd, n, timeout) < 0) continue;
        for (int k = 0; k < n; k++) {
            short re = pfd[k].revents;
            if (!re) continue;
            if (owner[k] == -1) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) == sizeof si) {}
                int st;
                pid_t p;
                while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
                    if (p == init_pid) { init_pid = -1; init_restart_at = now_ms() + 100; unlink(CTL); }
                }
            } else if (owner[k] == -2) {
                if (re & POLLHUP) { reset_all(); hup_wait = 1; continue; }   /* host end closed */
                if (re & POLLIN) {
                    ssize_t r = read(port, inq + in_len, sizeof inq - in_len);
                    if (r > 0) { in_len += r; parse(); }
                }
                if (re & POLLOUT) flush_port();
            } else {
                struct ch *c = &chans[owner[k]];
                if (!c->used) continue;
                if (re & POLLOUT || ((re & (POLLERR | POLLHUP)) && (c->len > c->off || c->eof_pending))) ch_write(c);
                if (c->used && (re & (POLLIN | POLLHUP | POLLERR))) ch_read(c);
            }
        }
        if (out_len > out_off) flush_port();
        if (hup_wait) usleep(20000);             /* poll keeps reporting POLLHUP until the host connects */
    }
}

/* pd-init: PID 1 of every PillDrops sandbox, and its command supervisor.
 *
 * As init: reaps every zombie re-parented to it and exits 0 on SIGTERM or SIGINT. Signals are blocked
 * and read from a signalfd: as a pid-namespace init, signals with a default disposition would be ignored.
 * Checkpoint support (issue 6): its stdin/stdout/stderr are reopened on the sandbox's own /dev/null, so it
 * holds no host file. SIGUSR1 from the host closes the control socket and unlinks /.pd/run/ctl (before a
 * CRIU dump: criu 4.1.1 cannot restore a path-bound unix socket of a process that CRIU also has to give a
 * session/group-leader helper, i.e. as soon as a background command outlived its shell); SIGUSR2 from the
 * host listens again (after a restore, or a failed dump). Only signals from outside the sandbox's pid
 * namespace (ssi_pid 0) count.
 *
 * As supervisor (only when the directory /.pd/run exists, bind-mounted read-write from the host's
 * <sandbox dir>/pd): listens on the unix stream socket /.pd/run/ctl (mode 0600). One command per
 * connection. Every frame, both ways, is  u8 type | u32 length (little endian) | payload.
 *
 *   agent -> pd-init   'H' u32 the agent's protocol version (optional, before 'R'; a v1 agent sends none)
 *                      'R' request: u8 flags (1 = stdin frames follow, 2 = PTY, 4 = user, 8 = the pid may
 *                          wait: 'P' goes out with the first output or the exit, at most HOLD_MS after the
 *                          fork; the agent of a run asks for it, so a short command wakes it once) | u32 argc |
 *                          u32 envc | [u16 rows | u16 cols, with flag 2] | [u32 uid | u32 gid, with flag 4] |
 *                          cwd\0 argv[0]\0 ... env[0]\0 ...
 *                          (exactly once)
 *                      'I' stdin bytes        'E' stdin EOF        'K' kill the command's process group
 *                      'S' i32 signal for the command's process group (v2)
 *                      'W' u16 rows | u16 cols: window size of the PTY (v2)
 *                      (EOF or hang-up of the connection before the exit frame also kills)
 *   pd-init -> agent   'V' u32 PROTO, the answer to 'H' (a v1 init closes the connection on 'H' instead:
 *                          the agent sees EOF before any frame and knows the init is too old)
 *                      'P' i32 pid (in the sandbox's pid namespace), right after the fork
 *                      'O' stdout bytes (with a PTY: everything the terminal wrote)       'e' stderr bytes
 *                      'X' i32 exit code (128+N when killed by signal N), last frame
 *
 * With a PTY the command gets a new pseudo-terminal (opened from the sandbox's own devpts: TIOCGPTPEER, so
 * no path is looked up; gVisor lacks that ioctl, there it is opened by its number: pty_peer) as its
 * controlling terminal and stdin/stdout/stderr; Ctrl-C (0x03 in 'I') reaches its foreground process group
 * through the terminal's line discipline, and 'W' raises SIGWINCH there. A command that cannot be started
 * (no terminal, no pipe, no fork) gets its reason on stderr ('e') and exit 126, never a dropped connection.
 *
 * Every command runs under a shepherd (issue 16 part 3): a fork of pd-init that makes itself a child
 * subreaper (PR_SET_CHILD_SUBREAPER) and session leader, forks the command and waits for it. So every
 * process the command starts stays below the shepherd, even one that does setsid() or double-forks (an
 * orphan is re-parented to the nearest subreaper, not to PID 1). A kill ('K', EOF, the agent's timeout)
 * walks /proc for every descendant of the shepherd and SIGKILLs each (again until a walk finds no new
 * one: a killed process forks no more), then the shepherd: whatever the command did to itself (ignore
 * SIGTERM, SIGSTOP itself, close its pipes, leave its session) it cannot outlive its kill. The shepherd
 * blocks every signal and holds no fd but its pid pipe; it exits with the command's status (128+N when
 * killed by signal N) as soon as the command's own process is reaped, so background processes a command
 * leaves behind when it exits normally go on running (re-parented to PID 1), as from a shell. Under gVisor,
 * which re-parents every orphan to PID 1 in spite of the subreaper, pd-init runs with --cgroups and each
 * command also gets a cgroup of its own, which a kill empties (see cg_setup).
 * The command's pid reaches pd-init through that pipe, so 'P' and $$ stay the command's own pid.
 *
 * The command does setpgid(0, 0) (so -pid names its process group; with a PTY it becomes the terminal's
 * foreground group), with flag 4 drops to uid:gid (no supplementary groups; failure: message on stderr,
 * exit 126; a template's USER), chdir(cwd) (failure: message on stderr, exit 126), dup2s the pipes and execvp()s argv
 * with environ = env, so PATH comes from env (failure: message on stderr, exit 127). It inherits every
 * restriction of the sandbox (namespaces, cgroup, capabilities, seccomp, no_new_privs) because it is a
 * plain fork of the sandbox's init.
 * The exit frame is sent once the child has been reaped and its pipes are at EOF, or have been quiet for
 * GRACE_MS (a background child may hold them open: the command returns when it exits, as a shell would).
 * Nothing is buffered unboundedly: a child's pipes are not read while its out buffer is full.
 * Built statically (gcc -static -Os) so it needs nothing from the sandbox's rootfs.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define RUN_DIR "/.pd/run"
#define SOCK_PATH RUN_DIR "/ctl"
#define NSLOTS 64
#define OUTBUF (32 * 1024)
#define INBUF (16 * 1024 + 5)
#define INBUF_ROW (20 * 1024)                /* whole pages, so a released row is given back */
#define MAX_REQ (4 * 1024 * 1024)
#define GRACE_MS 100
#define HOLD_MS 20                           /* flag 8: longest 'P' waits for output or the exit */
#define PROTO 2                              /* control protocol version, answered to 'H' */

enum { FREE, REQ, RUN };

struct slot {
    int state, conn, in_w, out_r, err_r;   /* -1 when closed */
    pid_t pid, pgid;                       /* pid: the shepherd's, 0 once reaped; pgid: the command's
                                            * process group, kept for late kills */
    unsigned cg;                           /* the command's cgroup (its number in pd-init's cgroupfs), 0: none */
    int status, exited, killed, exit_sent, conn_dead, rd_closed, in_blocked, pty;
    long long quiet_since;                 /* ms; when the pipes last produced data after the exit */
    long long hold;                        /* flag 8: ms until which nothing is sent unless output or the
                                            * exit comes first; 0: send as soon as there is something */
    char *req;                             /* request payload (malloc'ed once per request) */
    uint32_t req_len, req_got;
    uint32_t in_len, in_off;               /* inbuf: bytes held, bytes of a stdin payload written */
    uint32_t out_off, out_len;             /* outbuf: [out_off, out_len) waits to be sent */
    unsigned char *in, *out;               /* this slot's rows of inbufs / outbufs */
};

/* Metadata is compact (touched for every slot on each loop); the buffers are separate and only
 * touched while a slot is used, and their pages are handed back when it is released. */
static struct slot slots[NSLOTS];
static unsigned char inbufs[NSLOTS][INBUF_ROW] __attribute__((aligned(4096)));
static unsigned char outbufs[NSLOTS][OUTBUF] __attribute__((aligned(4096)));
extern char **environ;

/* The commands' cgroups (``--cgroups``, gVisor): the root directory of a cgroupfs mount no path leads to.
 * Its fd is parked in the queue of a socketpair (SCM_RIGHTS) between uses, never left in the fd table:
 * gVisor's /proc lets any process follow another's /proc/PID/fd links (but opens no socket that way). */
static int cg_park[2] = {-1, -1};
static int cg_on;
static unsigned cg_seq;
/* cgroups not yet empty when their command ended. Each holds at least one live process, so their number is
 * bounded by the sandbox's pids limit; the list grows to that (up to CG_PENDING_MAX entries, far above any
 * pids limit the node sets) instead of forgetting a cgroup. */
#define CG_PENDING_MAX (1 << 20)
static unsigned *cg_pending;
static int cg_npending, cg_pending_cap;

/* a shepherd's report that it could not join its cgroup: -(errno) - CG_JOIN_FAILED on the pid pipe */
#define CG_JOIN_FAILED 0x10000

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static void put_u32(unsigned char *p, uint32_t v) {
    p[0] = v; p[1] = v >> 8; p[2] = v >> 16; p[3] = v >> 24;
}

static uint32_t get_u32(const unsigned char *p) {
    return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24;
}

static void cl(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* Queue a 4-byte frame (pid / exit). Room is kept for it: pipes are read only with room to spare. */
static void frame(struct slot *s, int type, int32_t v) {
    if (s->conn_dead || s->out_len + 9 > OUTBUF) return;
    unsigned char *p = s->out + s->out_len;
    p[0] = type;
    put_u32(p + 1, 4);
    put_u32(p + 5, (uint32_t)v);
    s->out_len += 9;
}

static void cg_done(unsigned n);

static void release(struct slot *s) {
    cl(&s->conn); cl(&s->in_w); cl(&s->out_r); cl(&s->err_r);
    free(s->req);
    cg_done(s->cg);
    unsigned char *in = s->in, *out = s->out;
    memset(s, 0, sizeof *s);
    s->in = in;
    s->out = out;
    s->conn = s->in_w = s->out_r = s->err_r = -1;
    s->state = FREE;
    /* give the buffers' whole pages back so an idle supervisor stays small */
    madvise(in, INBUF_ROW, MADV_DONTNEED);
    madvise(out, OUTBUF, MADV_DONTNEED);
}

/* SIGKILL every live descendant of ``root`` (found through /proc ppid links; the shepherd is a subreaper,
 * so no descendant is ever re-parented past it). Each one found is first SIGSTOPped, walking again until a
 * walk finds no new one, and only then is everything found SIGKILLed: a process killed in the middle of the
 * tree would orphan its children before the next walk, and where the subreaper does not hold (gVisor
 * re-parents orphans to PID 1) they would no longer be found. */
static void kill_tree(pid_t root) {
    size_t cap = 0, n = 0, ncap = 0, nkilled = 0;
    pid_t *pid = NULL, *ppid = NULL, *killed = NULL;
    kill(root, SIGSTOP);
    for (int pass = 0; pass < 64; pass++) {
        DIR *d = opendir("/proc");
        if (!d) break;
        n = 0;
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
            char path[64], buf[512];
            snprintf(path, sizeof path, "/proc/%d/stat", atoi(e->d_name));
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0) continue;
            ssize_t len = read(fd, buf, sizeof buf - 1);
            close(fd);
            if (len <= 0) continue;
            buf[len] = 0;
            char *rp = strrchr(buf, ')');
            char state;
            int pp;
            if (!rp || sscanf(rp + 1, " %c %d", &state, &pp) != 2 || state == 'Z' || state == 'X') continue;
            if (n == cap) {
                size_t nc = cap ? cap * 2 : 256;
                pid_t *a = realloc(pid, nc * sizeof *a), *b = a ? realloc(ppid, nc * sizeof *b) : NULL;
                if (a) pid = a;
                if (!b) break;
                ppid = b;
                cap = nc;
            }
            pid[n] = atoi(e->d_name);
            ppid[n++] = pp;
        }
        closedir(d);
        /* mark descendants: ppid[i] becomes 0 once i is known to be one (pid[i] kept), until stable */
        char *mark = calloc(n ? n : 1, 1);
        if (!mark) break;
        for (int changed = 1; changed;) {
            changed = 0;
            for (size_t i = 0; i < n; i++) {
                if (mark[i]) continue;
                int in = ppid[i] == root;
                for (size_t j = 0; !in && j < n; j++) in = mark[j] && pid[j] == ppid[i];
                if (in) { mark[i] = 1; changed = 1; }
            }
        }
        int fresh = 0;
        for (size_t i = 0; i < n; i++) {
            if (!mark[i]) continue;
            int seen = 0;
            for (size_t k = 0; k < nkilled && !seen; k++) seen = killed[k] == pid[i];
            if (seen) continue;
            kill(pid[i], SIGSTOP);
            fresh = 1;
            if (nkilled == ncap) {
                size_t nc = ncap ? ncap * 2 : 64;
                pid_t *a = realloc(killed, nc * sizeof *a);
                if (!a) { kill(pid[i], SIGKILL); continue; }   /* unrecorded: never left stopped */
                killed = a;
                ncap = nc;
            }
            killed[nkilled++] = pid[i];
        }
        free(mark);
        if (!fresh) break;
    }
    for (size_t k = 0; k < nkilled; k++) kill(killed[k], SIGKILL);
    free(pid); free(ppid); free(killed);
}

/* ``--cgroups`` (gVisor): a cgroup per command. runsc ignores PR_SET_CHILD_SUBREAPER (its Sentry re-parents
 * every orphan to PID 1), so the /proc walk of kill_tree cannot find a process that left the command's
 * session after its parent exited; but a process is born in its parent's cgroup and stays there whatever
 * becomes of its parents. So pd-init mounts a cgroupfs hierarchy of its own (gVisor's, inside the Sentry)
 * over /.pd/run for a moment, takes a directory fd on it and detaches it (MNT_DETACH): no path leads to it.
 * No process of the sandbox can mount another (pd-init holds CAP_SYS_ADMIN only in its permitted and
 * effective sets, never in the bounding set, and drops it here, before any command exists), and the fd
 * waits in cg_park between uses, so a command neither sees its cgroup nor can move out of it; only a
 * process that catches the fd in pd-init's fd table during the few system calls of a use could (a
 * deliberate race, which wins nothing a command cannot have by exiting and leaving a daemon behind). Each
 * shepherd joins a fresh cgroup before it forks the command, and a kill SIGKILLs everything listed in the
 * cgroup's cgroup.procs. */
/* Park ``fd`` (closed here) in cg_park's queue; 0 when it is there. */
static int cg_put(int fd) {
    char b = 0;
    struct iovec iov = {.iov_base = &b, .iov_len = 1};
    union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } u;
    memset(&u, 0, sizeof u);
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    int ok = sendmsg(cg_park[1], &m, MSG_DONTWAIT | MSG_NOSIGNAL) == 1;
    close(fd);
    if (!ok) cg_on = 0;                        /* lost: later commands are tracked by kill_tree alone */
    return ok ? 0 : -1;
}

/* Take the cgroupfs root out of cg_park (give it back with cg_put); -1 when there is none. */
static int cg_take(void) {
    if (!cg_on) return -1;
    char b;
    struct iovec iov = {.iov_base = &b, .iov_len = 1};
    union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } u;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    int fd = -1;
    if (recvmsg(cg_park[0], &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) == 1) {
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)))
            memcpy(&fd, CMSG_DATA(c), sizeof fd);
    }
    if (fd < 0) cg_on = 0;
    return fd;
}

/* Mount and park the cgroupfs root, then drop CAP_SYS_ADMIN. A failure to set up the cgroups is logged on
 * pd-init's stderr (the runtime's log of the init, before main points stdio at /dev/null) and leaves
 * commands to kill_tree alone; a failure to drop the capability is fatal: no command may start while
 * pd-init could hand it on or be made to use it. */
static void cg_setup(void) {
    if (socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, cg_park) != 0) {
        dprintf(2, "pd-init: --cgroups: socketpair: %s: no cgroup per command\n", strerror(errno));
    } else if (mount("pd", RUN_DIR, "cgroup", MS_NOSUID | MS_NODEV | MS_NOEXEC, "cpu") != 0) {
        dprintf(2, "pd-init: --cgroups: mount cgroupfs on %s: %s: no cgroup per command\n", RUN_DIR, strerror(errno));
    } else {
        int root = open(RUN_DIR, O_DIRECTORY | O_RDONLY | O_CLOEXEC), root_errno = errno;
        if (umount2(RUN_DIR, MNT_DETACH) != 0) {
            /* the cgroupfs stays visible at RUN_DIR: use none of it (a command could reach it by path) */
            dprintf(2, "pd-init: --cgroups: umount %s: %s\n", RUN_DIR, strerror(errno));
            _exit(111);
        }
        if (root >= 0) {
            cg_on = 1;
            if (cg_put(root) != 0) dprintf(2, "pd-init: --cgroups: cannot park the cgroupfs: no cgroup per command\n");
        } else {
            dprintf(2, "pd-init: --cgroups: open cgroupfs: %s: no cgroup per command\n", strerror(root_errno));
        }
    }
    struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct d[2];
    int ok = syscall(SYS_capget, &h, d) == 0;
    if (ok) {
        d[0].effective &= ~(1u << CAP_SYS_ADMIN);
        d[0].permitted &= ~(1u << CAP_SYS_ADMIN);
        d[0].inheritable &= ~(1u << CAP_SYS_ADMIN);
        ok = syscall(SYS_capset, &h, d) == 0;
    }
    /* check that it is really gone (capset answers 0 and drops it, or else this init must not go on) */
    ok = ok && syscall(SYS_capget, &h, d) == 0 &&
         !((d[0].effective | d[0].permitted | d[0].inheritable) & (1u << CAP_SYS_ADMIN));
    if (!ok) {
        dprintf(2, "pd-init: --cgroups: cannot drop CAP_SYS_ADMIN: %s\n", strerror(errno));
        _exit(111);
    }
}

/* A fresh cgroup for a command: its number (0: none, the command is then tracked by kill_tree alone), and
 * in *procs an fd on its cgroup.procs, which the shepherd writes itself into before it forks the command. */
static unsigned cg_new(int *procs) {
    *procs = -1;
    int root = cg_take();
    if (root < 0) return 0;
    char name[32];
    unsigned n = ++cg_seq ? cg_seq : ++cg_seq;
    snprintf(name, sizeof name, "%u", n);
    if (mkdirat(root, name, 0700) == 0) {
        snprintf(name, sizeof name, "%u/cgroup.procs", n);
        if ((*procs = openat(root, name, O_WRONLY | O_CLOEXEC)) < 0) {
            snprintf(name, sizeof name, "%u", n);
            unlinkat(root, name, AT_REMOVEDIR);
        }
    }
    if (cg_put(root) != 0 && *procs >= 0) { close(*procs); *procs = -1; }
    return *procs >= 0 ? n : 0;
}

/* Remove cgroup n once it is empty; while it is not (background processes of a command that exited), it
 * waits in cg_pending, retried whenever pd-init reaps a process (the last one of a cgroup to exit is
 * always re-parented to pd-init: a parent in the cgroup would still be in it). */
static int cg_rmdir(int root, unsigned n) {
    char name[16];
    snprintf(name, sizeof name, "%u", n);
    return unlinkat(root, name, AT_REMOVEDIR) == 0 || errno == ENOENT;
}

static void cg_sweep_in(int root) {
    for (int i = 0; i < cg_npending;)
        if (cg_rmdir(root, cg_pending[i])) cg_pending[i] = cg_pending[--cg_npending];
        else i++;
}

static void cg_done(unsigned n) {
    int root = n ? cg_take() : -1;
    if (root < 0) return;
    if (!cg_rmdir(root, n)) {
        if (cg_npending == cg_pending_cap) cg_sweep_in(root);     /* full: first drop those emptied since */
        if (cg_npending == cg_pending_cap && cg_pending_cap < CG_PENDING_MAX) {
            int nc = cg_pending_cap ? cg_pending_cap * 2 : 256;
            unsigned *a = realloc(cg_pending, (size_t)nc * sizeof *a);
            if (a) { cg_pending = a; cg_pending_cap = nc; }
        }
        if (cg_npending < cg_pending_cap) cg_pending[cg_npending++] = n;
        else dprintf(2, "pd-init: cgroup %u left behind: %d cgroups wait to be emptied\n", n, cg_npending);
    }
    cg_put(root);
}

static void cg_sweep(void) {
    int root = cg_take();
    if (root < 0) return;
    cg_sweep_in(root);
    cg_put(root);
}

/* SIGKILL every process in cgroup n, reading its cgroup.procs again until a read lists none not killed yet
 * (a process forked in the meantime is born in the cgroup). The list is bounded by the pids limit. */
static int cg_kill(unsigned n) {
    int root = cg_take();
    if (root < 0) return -1;
    char name[32];
    snprintf(name, sizeof name, "%u/cgroup.procs", n);
    pid_t *done = NULL;
    size_t ndone = 0, cap = 0;
    int settled = 0;                           /* a read listed no process not killed yet */
    for (int pass = 0; pass < 64 && !settled; pass++) {
        int fd = openat(root, name, O_RDONLY | O_CLOEXEC), fresh = 0;
        if (fd < 0) break;
        char buf[4096];
        long long cur = -1;
        ssize_t len;
        do {
            len = read(fd, buf, sizeof buf);
            for (ssize_t i = 0; i <= len; i++) {
                if (i < len && buf[i] >= '0' && buf[i] <= '9') {
                    cur = (cur < 0 ? 0 : cur) * 10 + (buf[i] - '0');
                    if (cur > INT32_MAX) cur = INT32_MAX;
                    continue;
                }
                if (i == len && len > 0) break;        /* a number may go on in the next read */
                if (cur > 1) {
                    int seen = 0;
                    for (size_t k = 0; k < ndone && !seen; k++) seen = done[k] == (pid_t)cur;
                    if (!seen) {
                        kill((pid_t)cur, SIGKILL);
                        fresh = 1;
                        if (ndone == cap) {
                            size_t nc = cap ? cap * 2 : 64;
                            pid_t *a = realloc(done, nc * sizeof *a);
                            if (a) { done = a; cap = nc; }
                        }
                        if (ndone < cap) done[ndone++] = (pid_t)cur;
                    }
                }
                cur = -1;
            }
        } while (len > 0 || (len < 0 && errno == EINTR));
        close(fd);
        settled = !fresh;
    }
    free(done);
    cg_put(root);
    return settled ? 0 : -1;                   /* not settled: the caller's kill_tree goes after the rest */
}

static void do_kill(struct slot *s) {
    if (!s->killed && s->pgid > 0) {
        if (s->pid > 0 && !(s->cg && cg_kill(s->cg) == 0)) kill_tree(s->pid);
        kill(-s->pgid, SIGKILL);
        if (s->pid > 0) kill(s->pid, SIGKILL);
    }
    s->killed = 1;
}

static void flush(struct slot *s) {
    if (s->hold) return;
    while (s->out_off < s->out_len && !s->conn_dead) {
        ssize_t n = send(s->conn, s->out + s->out_off, s->out_len - s->out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) s->out_off += n;
        else if (n < 0 && errno == EINTR) continue;
        else if (n < 0 && errno == EAGAIN) break;
        else { s->conn_dead = 1; do_kill(s); }        /* the agent is gone: kill, drain, discard */
    }
    if (s->conn_dead || s->out_off == s->out_len) s->out_off = s->out_len = 0;
    else if (s->out_off > OUTBUF / 2) {
        memmove(s->out, s->out + s->out_off, s->out_len - s->out_off);
        s->out_len -= s->out_off;
        s->out_off = 0;
    }
}

static void child(int in_r, int out_w, int err_w, char *cwd, char **argv, char **env, int tty,
                  const uint32_t *ids) {
    sigset_t all;
    sigfillset(&all);
    setpgid(0, 0);
    if (tty >= 0) {                            /* the terminal's foreground group (SIGTTOU still blocked) */
        tcsetpgrp(tty, getpid());
        in_r = out_w = err_w = tty;
    }
    sigprocmask(SIG_UNBLOCK, &all, NULL);
    if (in_r < 0) in_r = open("/dev/null", O_RDONLY | O_CLOEXEC);
    dup2(in_r, 0); dup2(out_w, 1); dup2(err_w, 2);
    if (ids && (setgroups(0, NULL) != 0 || setgid(ids[1]) != 0 || setuid(ids[0]) != 0)) {
        dprintf(2, "pd-init: cannot run as %u:%u: %s\n", ids[0], ids[1], strerror(errno));
        _exit(126);
    }
    if (chdir(cwd) != 0) {
        dprintf(2, "pd-init: chdir to `%s`: %s\n", cwd, strerror(errno));
        _exit(126);
    }
    environ = env;
    execvp(argv[0], argv);
    int e = errno;
    dprintf(2, "pd-init: exec `%s`: %s\n", argv[0], strerror(e));
    _exit(e == ENOENT ? 127 : 126);
}

/* The shepherd (see the top): session leader (with the PTY as controlling terminal), child subreaper,
 * every signal blocked; forks the command, sends its pid on ``pid_w``, and exits with its status. */
static void shepherd(int in_r, int out_w, int err_w, int pid_w, char *cwd, char **argv, char **env, int tty,
                     const uint32_t *ids, int cg_procs) {
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    setsid();
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    if (tty >= 0) ioctl(tty, TIOCSCTTY, 0);
    if (cg_procs >= 0) {                       /* join the command's cgroup (--cgroups) before the fork */
        char b[16];
        int n = snprintf(b, sizeof b, "%d", (int)getpid());
        if (write(cg_procs, b, n) != n) {
            /* the reason goes back on pid_w (spawn's errno); err_w is closed unread when start() fails */
            int32_t why = -(errno ? errno : EIO) - CG_JOIN_FAILED;
            if (write(pid_w, &why, sizeof why) != sizeof why) _exit(127);
            _exit(126);
        }
        close(cg_procs);
    }
    pid_t c = fork();
    int32_t v = c < 0 ? -errno : c;            /* the command's pid, or why it has none */
    if (c == 0) { close(pid_w); child(in_r, out_w, err_w, cwd, argv, env, tty, ids); }
    if (c > 0) setpgid(c, c);
    if (write(pid_w, &v, sizeof v) != sizeof v || c < 0) _exit(127);
    /* hold nothing of the command's or of other commands': no pipe end, socket or terminal */
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) { dup2(null, 0); dup2(null, 1); dup2(null, 2); }
    closefrom(3);
    for (;;) {
        int st;
        pid_t w = waitpid(-1, &st, 0);
        if (w == c) _exit(WIFSIGNALED(st) ? 128 + WTERMSIG(st) : WEXITSTATUS(st));
        if (w < 0 && errno == ECHILD) _exit(127);
    }
}

/* Fork the shepherd; the command's pid (read back from it) goes to *cmd. On failure errno says why, and
 * *cg_failed whether it was the shepherd's join of the command's cgroup. */
static pid_t spawn(int in_r, int out_w, int err_w, char *cwd, char **argv, char **env, int tty,
                   const uint32_t *ids, int *cg_procs, pid_t *cmd, int *cg_failed) {
    int pp[2];
    if (pipe2(pp, O_CLOEXEC) != 0) return -1;
    pid_t pid = fork();
    int fork_errno = errno;
    if (pid == 0) { close(pp[0]); shepherd(in_r, out_w, err_w, pp[1], cwd, argv, env, tty, ids, *cg_procs); }
    cl(cg_procs);                                    /* the shepherd's alone from here */
    close(pp[1]);
    if (pid < 0) { close(pp[0]); errno = fork_errno; return -1; }
    int32_t v = -1;
    ssize_t n;
    do n = read(pp[0], &v, sizeof v); while (n < 0 && errno == EINTR);
    close(pp[0]);
    if (n != sizeof v || v <= 0) {                   /* the shepherd could not fork the command */
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        *cg_failed = n == sizeof v && v < -CG_JOIN_FAILED;
        if (*cg_failed) v += CG_JOIN_FAILED;
        errno = n == sizeof v && v < 0 ? -v : ECHILD;
        return -1;
    }
    *cmd = v;
    return pid;
}

/* The terminal side of the PTY whose master is ``master``. TIOCGPTPEER opens it without a path lookup;
 * gVisor (runsc 20221219, Debian's) answers it ENOTTY, so there the peer is opened by its number
 * (TIOCGPTN) in the sandbox's own devpts, and kept only if it is that number's terminal device on a devpts
 * (a path the sandbox cannot remount: it holds no CAP_SYS_ADMIN). */
static int pty_peer(int master) {
    int fd = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (fd >= 0 || (errno != ENOTTY && errno != EINVAL)) return fd;
    unsigned n;
    if (ioctl(master, TIOCGPTN, &n) != 0) return -1;
    char path[32];
    snprintf(path, sizeof path, "/dev/pts/%u", n);
    if ((fd = open(path, O_RDWR | O_NOCTTY | O_CLOEXEC | O_NOFOLLOW)) < 0) return -1;
    struct stat st;
    struct statfs fs;
    /* Unix98 ptys: Linux numbers pts N major 136 + N / 256, minor N % 256 (majors 136..143); this gVisor
     * major 136, minor N: both are (major - 136) * 256 + minor == N */
    if (fstat(fd, &st) != 0 || !S_ISCHR(st.st_mode) || major(st.st_rdev) < 136 || major(st.st_rdev) > 143 ||
        (major(st.st_rdev) - 136) * 256 + minor(st.st_rdev) != n ||
        fstatfs(fd, &fs) != 0 || fs.f_type != 0x1cd1 /* DEVPTS_SUPER_MAGIC */) {
        close(fd);
        errno = ENXIO;
        return -1;
    }
    return fd;
}

/* A command that could not be started for a reason the sandbox has (no terminal, no fork): its message on
 * stderr and exit 126, so the agent reports it instead of a lost connection (137 with no output). */
static void start_failed(struct slot *s, const char *what, int err) {
    char msg[160];
    int len = snprintf(msg, sizeof msg, "pd-init: %s: %s\n", what, strerror(err));
    if (len < 0) len = 0;
    if (len >= (int)sizeof msg) len = sizeof msg - 1;
    unsigned char *h = s->out + s->out_len;
    if (!s->conn_dead && s->out_len + 5 + len + 9 <= OUTBUF) {
        h[0] = 'e';
        put_u32(h + 1, len);
        memcpy(h + 5, msg, len);
        s->out_len += 5 + len;
    }
    s->state = RUN;
    s->exited = 1;
    s->status = 126;
    frame(s, 'X', 126);
    s->exit_sent = 1;
    s->hold = 0;
    flush(s);
}

static int start(struct slot *s) {
    char *p = s->req, *end = s->req + s->req_len;
    if (s->req_len < 9) return -1;
    int has_stdin = p[0] & 1, pty = p[0] & 2, has_user = p[0] & 4, hold = (p[0] & 8) && !has_stdin && !pty;
    uint32_t argc = get_u32((unsigned char *)p + 1), envc = get_u32((unsigned char *)p + 5);
    if (argc == 0 || argc > s->req_len || envc > s->req_len ||
        s->req_len < 9 + (pty ? 4 : 0) + (has_user ? 8 : 0)) return -1;
    struct winsize ws = {0};
    uint32_t ids_buf[2], *ids = NULL;
    unsigned char *q = (unsigned char *)p + 9;
    if (pty) {
        ws.ws_row = q[0] | q[1] << 8;
        ws.ws_col = q[2] | q[3] << 8;
        q += 4;
    }
    if (has_user) {
        ids_buf[0] = get_u32(q);
        ids_buf[1] = get_u32(q + 4);
        ids = ids_buf;
        q += 8;
    }
    p = (char *)q;
    char **vec = calloc(argc + envc + 2, sizeof(char *));
    if (!vec) return -1;
    char *cwd = NULL;
    for (uint32_t i = 0; i < 1 + argc + envc; i++) {
        char *z = p < end ? memchr(p, 0, end - p) : NULL;
        if (!z) { free(vec); return -1; }
        if (i == 0) cwd = p;
        else if (i <= argc) vec[i - 1] = p;
        else vec[i] = p;                       /* vec[argc] stays NULL; env is vec + argc + 1 */
        p = z + 1;
    }
    int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1}, tty = -1, cg_procs, cg_failed = 0;
    pid_t pid = -1, cmd = -1;
    unsigned cg = cg_new(&cg_procs);
    const char *failed = "cannot start the command";
    int unlock = 0;
    if (pty) {           /* master: out[0] (read) and in[1] (a dup, write); slave: tty, for the child only */
        failed = "cannot open a terminal";
        out[0] = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (out[0] >= 0 && ioctl(out[0], TIOCSPTLCK, &unlock) == 0 && ioctl(out[0], TIOCSWINSZ, &ws) == 0 &&
            (tty = pty_peer(out[0])) >= 0 && (in[1] = fcntl(out[0], F_DUPFD_CLOEXEC, 0)) >= 0) {
            failed = "cannot start the command";
            pid = spawn(-1, -1, -1, cwd, vec, vec + argc + 1, tty, ids, &cg_procs, &cmd, &cg_failed);
        }
    } else if (!(has_stdin && pipe2(in, O_CLOEXEC)) && !pipe2(out, O_CLOEXEC) && !pipe2(err, O_CLOEXEC)) {
        pid = spawn(in[0], out[1], err[1], cwd, vec, vec + argc + 1, -1, ids, &cg_procs, &cmd, &cg_failed);
    }
    int err_no = errno;
    if (cg_failed) failed = "cannot join the command's cgroup";
    free(vec);
    free(s->req);
    s->req = NULL;
    cl(&in[0]); cl(&out[1]); cl(&err[1]); cl(&tty); cl(&cg_procs);
    if (pid < 0) {
        cl(&in[1]); cl(&out[0]); cl(&err[0]); cg_done(cg);
        start_failed(s, failed, err_no);
        return 0;
    }
    s->cg = cg;
    s->pty = pty != 0;
    s->in_w = in[1]; s->out_r = out[0]; s->err_r = err[0];
    if (s->in_w >= 0) fcntl(s->in_w, F_SETFL, O_NONBLOCK);
    fcntl(s->out_r, F_SETFL, O_NONBLOCK);
    if (s->err_r >= 0) fcntl(s->err_r, F_SETFL, O_NONBLOCK);
    s->pid = pid;
    s->pgid = cmd;
    s->state = RUN;
    frame(s, 'P', cmd);
    if (hold) s->hold = now_ms() + HOLD_MS;
    return 0;
}

/* Act on the complete frames held in the in buffer. Returns -1 when the slot was released. */
static int frames(struct slot *s) {
    while (s->in_len >= 5) {
        uint32_t len = get_u32(s->in + 1);
        int type = s->in[0];
        if (s->state == REQ && type == 'H') {            /* version hello: answer ours */
            if (len != 4) { release(s); return -1; }
            if (s->in_len < 9) return 0;
            frame(s, 'V', PROTO);
            memmove(s->in, s->in + 9, s->in_len - 9);
            s->in_len -= 9;
            continue;
        }
        if (s->state == REQ) {
            if (type != 'R' || len > MAX_REQ || !(s->req = malloc(len ? len : 1))) { release(s); return -1; }
            s->req_len = len;
            s->req_got = s->in_len - 5 < len ? s->in_len - 5 : len;
            memcpy(s->req, s->in + 5, s->req_got);
            memmove(s->in, s->in + 5 + s->req_got, s->in_len - 5 - s->req_got);
            s->in_len -= 5 + s->req_got;
            if (s->req_got < len) return 0;
            if (start(s) < 0) { release(s); return -1; }
            continue;
        }
        if (len > INBUF - 5) { do_kill(s); s->rd_closed = 1; s->in_len = 0; return 0; }
        if (s->in_len < 5 + len) return 0;
        s->in_blocked = 0;
        if (type == 'I' && s->in_w >= 0) {
            while (s->in_off < len) {
                ssize_t w = write(s->in_w, s->in + 5 + s->in_off, len - s->in_off);
                if (w > 0) s->in_off += w;
                else if (w < 0 && errno == EINTR) continue;
                else if (w < 0 && errno == EAGAIN) { s->in_blocked = 1; return 0; }   /* POLLOUT later */
                else { cl(&s->in_w); break; }            /* the child closed stdin: drop the rest */
            }
        } else if (type == 'E') {
            cl(&s->in_w);
        } else if (type == 'K') {
            do_kill(s);
        } else if (type == 'S' && len == 4) {
            int sig = (int)get_u32(s->in + 5);
            if (sig > 0 && sig < 65 && !s->killed && s->pgid > 0) kill(-s->pgid, sig);
        } else if (type == 'W' && len == 4 && s->pty) {
            struct winsize ws = {.ws_row = s->in[5] | s->in[6] << 8, .ws_col = s->in[7] | s->in[8] << 8};
            int fd = s->in_w >= 0 ? s->in_w : s->out_r;
            if (fd >= 0) ioctl(fd, TIOCSWINSZ, &ws);
        }
        s->in_off = 0;
        memmove(s->in, s->in + 5 + len, s->in_len - 5 - len);
        s->in_len -= 5 + len;
    }
    return 0;
}

/* Read from the agent: the request, then stdin / EOF / kill frames. */
static void on_conn(struct slot *s) {
    ssize_t n;
    if (s->state == REQ && s->req) {
        n = read(s->conn, s->req + s->req_got, s->req_len - s->req_got);
        if (n <= 0) { if (n == 0 || (errno != EAGAIN && errno != EINTR)) release(s); return; }
        s->req_got += n;
        if (s->req_got == s->req_len && start(s) < 0) release(s);
        else if (s->req_got == s->req_len) frames(s);
        return;
    }
    n = read(s->conn, s->in + s->in_len, INBUF - s->in_len);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        s->rd_closed = 1;
        if (s->state == REQ) release(s);
        else do_kill(s);                       /* EOF before the exit frame: the agent gave up */
        return;
    }
    if (n > 0) {
        s->in_len += n;
        frames(s);
    }
}

/* Relay one read of a child pipe into the out buffer as one frame. */
static void on_pipe(struct slot *s, int *fd, int type) {
    unsigned char *h = s->out + s->out_len;
    ssize_t n = read(*fd, h + 5, OUTBUF - s->out_len - 5 - 9);   /* keep room for the exit frame */
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) { cl(fd); return; }
    if (n < 0) return;
    s->quiet_since = now_ms();
    s->hold = 0;                                                /* 'P' goes out with the first output */
    if (s->conn_dead) return;                                   /* nobody listens: drop */
    h[0] = type;
    put_u32(h + 1, n);
    s->out_len += 5 + n;
}

static void reap(void) {
    int st, any = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
        any = 1;
        for (int i = 0; i < NSLOTS; i++) {
            struct slot *s = &slots[i];
            if (s->state == RUN && s->pid == pid) {
                s->status = WIFSIGNALED(st) ? 128 + WTERMSIG(st) : WEXITSTATUS(st);
                s->exited = 1;
                s->pid = 0;
                s->quiet_since = now_ms();
            }
        }
    }
    if (any && cg_npending) cg_sweep();
}

static int listen_ctl(void) {
    struct stat st;
    if (stat(RUN_DIR, &st) != 0 || !S_ISDIR(st.st_mode)) return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strcpy(a.sun_path, SOCK_PATH);
    unlink(SOCK_PATH);
    mode_t old = umask(0177);
    int ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && chmod(SOCK_PATH, 0600) == 0 &&
             listen(fd, 128) == 0;
    umask(old);
    if (!ok) { if (fd >= 0) close(fd); return -1; }
    return fd;
}

#define NPFD (2 + 4 * NSLOTS)
static struct pollfd pfd[NPFD];
static short owner[NPFD], kind[NPFD];      /* slot index (-1: signalfd, -2: listener); fd kind */
enum { K_CONN, K_OUT, K_ERR, K_IN };

/* ``/.pd/init --shepherd CMD [ARG...]``: a command the agent runs with ``crun exec`` (its fallback without
 * the control socket) under a shepherd of its own: a child subreaper, so that every process the command
 * starts (setsid, double fork) stays below it, where the agent's kill finds it (a walk of the host's /proc
 * from this process, which is what crun exec's pid file names). Every signal is forwarded to the command,
 * orphans are reaped, and it exits with the command's status (128+N when killed by signal N). */
static int shepherd_exec(char **argv) {
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    pid_t c = fork();
    if (c < 0) { dprintf(2, "pd-init: fork: %s\n", strerror(errno)); return 126; }
    if (c == 0) {
        sigprocmask(SIG_UNBLOCK, &all, NULL);
        execvp(argv[0], argv);
        int e = errno;
        dprintf(2, "pd-init: exec `%s`: %s\n", argv[0], strerror(e));
        _exit(e == ENOENT ? 127 : 126);
    }
    /* hold no end of the command's pipes: its output ends when it closes them */
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) { dup2(null, 0); dup2(null, 1); dup2(null, 2); if (null > 2) close(null); }
    for (;;) {
        siginfo_t si;
        int sig = sigwaitinfo(&all, &si);
        if (sig < 0) continue;
        if (sig != SIGCHLD) { kill(c, sig); continue; }
        int st;
        pid_t w;
        while ((w = waitpid(-1, &st, WNOHANG)) > 0)
            if (w == c) return WIFSIGNALED(st) ? 128 + WTERMSIG(st) : WEXITSTATUS(st);
    }
}

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--shepherd") == 0) return shepherd_exec(argv + 2);
    if (argc > 1 && strcmp(argv[1], "--cgroups") == 0) cg_setup();
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGPIPE);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGUSR2);
    sigprocmask(SIG_BLOCK, &set, NULL);
    /* Orphans come to us and are reaped here even where we are not PID 1 (a microVM guest, under
     * pd-vmagent): a shepherd killed on a timeout leaves its killed descendants' zombies to us. */
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    /* Not dumpable: the sandbox's own root (same uid, no CAP_SYS_PTRACE) can then not ptrace this init
     * and take over its listening control socket (issue 16 item 2). Commands get it back at execve. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    /* Drop the stdio crun handed over (host files, e.g. crun's error log): an fd on a host file the
     * sandbox cannot see would make a CRIU checkpoint fail (issue 6). */
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) { dup2(null, 0); dup2(null, 1); dup2(null, 2); if (null > 2) close(null); }
    int sfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    int lfd = listen_ctl();
    for (int i = 0; i < NSLOTS; i++) {
        slots[i].conn = slots[i].in_w = slots[i].out_r = slots[i].err_r = -1;
        slots[i].in = inbufs[i];
        slots[i].out = outbufs[i];
    }
    reap();
    for (;;) {
        int n = 0, timeout = -1, nfree = 0;
        long long now = now_ms();
        pfd[n] = (struct pollfd){.fd = sfd, .events = POLLIN}; owner[n++] = -1;
        for (int i = 0; i < NSLOTS; i++) {
            struct slot *s = &slots[i];
            if (s->state == FREE) { nfree++; continue; }
            if (s->state == RUN && !s->exit_sent && s->exited) {
                int open_ = s->out_r >= 0 || s->err_r >= 0;
                if (!open_ || (now - s->quiet_since >= GRACE_MS && OUTBUF - s->out_len >= 9)) {
                    cl(&s->out_r); cl(&s->err_r);
                    frame(s, 'X', s->status);
                    s->exit_sent = 1;
                    s->hold = 0;
                    flush(s);
                }
            }
            if (s->exit_sent && (s->out_len == 0 || s->conn_dead)) { release(s); nfree++; continue; }
            if (s->hold && now >= s->hold) { s->hold = 0; flush(s); }
            if (s->hold) {
                int t = (int)(s->hold - now);
                if (timeout < 0 || t < timeout) timeout = t;
            }
            short ev = 0;
            if (!s->rd_closed) ev |= s->in_blocked || s->in_len == INBUF ? POLLRDHUP : POLLIN;
            if (s->out_len > s->out_off && !s->conn_dead && !s->hold) ev |= POLLOUT;
            if (ev && !s->conn_dead) { pfd[n] = (struct pollfd){.fd = s->conn, .events = ev}; owner[n] = i; kind[n++] = K_CONN; }
            if (s->state != RUN) continue;
            int room = OUTBUF - s->out_len >= 5 + 1024 + 9;
            if (room && s->out_r >= 0) { pfd[n] = (struct pollfd){.fd = s->out_r, .events = POLLIN}; owner[n] = i; kind[n++] = K_OUT; }
            if (room && s->err_r >= 0) { pfd[n] = (struct pollfd){.fd = s->err_r, .events = POLLIN}; owner[n] = i; kind[n++] = K_ERR; }
            if (s->in_blocked && s->in_w >= 0) { pfd[n] = (struct pollfd){.fd = s->in_w, .events = POLLOUT}; owner[n] = i; kind[n++] = K_IN; }
            if (s->exited && room) {
                long long left = s->quiet_since + GRACE_MS - now;
                int t = left < 0 ? 0 : (int)left + 1;
                if (timeout < 0 || t < timeout) timeout = t;
            }
        }
        if (lfd >= 0 && nfree > 0) { pfd[n] = (struct pollfd){.fd = lfd, .events = POLLIN}; owner[n++] = -2; }
        if (poll(pfd, n, timeout) < 0) continue;
        for (int k = 0; k < n; k++) {
            short re = pfd[k].revents;
            if (!re) continue;
            if (owner[k] == -1) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) == sizeof si) {
                    if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) { reap(); return 0; }
                    if (si.ssi_pid != 0) continue;                 /* sent from inside the sandbox */
                    if (si.ssi_signo == SIGUSR1 && lfd >= 0) { close(lfd); lfd = -1; unlink(SOCK_PATH); }
                    if (si.ssi_signo == SIGUSR2 && lfd < 0) lfd = listen_ctl();
                }
                reap();
                continue;
            }
            if (owner[k] == -2) {
                for (int i = 0; i < NSLOTS; i++) {
                    if (slots[i].state != FREE) continue;
                    int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
                    if (c < 0) break;
                    slots[i].conn = c;
                    slots[i].state = REQ;
                }
                continue;
            }
            struct slot *s = &slots[owner[k]];
            if (s->state == FREE) continue;
            switch (kind[k]) {
            case K_CONN:
                if (re & POLLOUT) flush(s);
                if (s->state != FREE && (re & (POLLIN | POLLHUP | POLLERR | POLLRDHUP)) && !s->rd_closed) {
                    if (re & POLLIN && !(s->in_blocked || s->in_len == INBUF)) on_conn(s);
                    else if (re & (POLLHUP | POLLERR | POLLRDHUP)) {
                        s->rd_closed = 1;
                        if (s->state == REQ) release(s); else do_kill(s);
                    }
                }
                break;
            case K_OUT: on_pipe(s, &s->out_r, 'O'); break;
            case K_ERR: on_pipe(s, &s->err_r, 'e'); break;
            case K_IN:
                if (re & (POLLERR | POLLHUP)) { cl(&s->in_w); s->in_blocked = 0; }
                frames(s);
                break;
            }
            if (s->state == RUN && s->out_len > s->out_off && !s->conn_dead) flush(s);
        }
    }
}

/* pd-init: PID 1 of every PillDrops sandbox.
 *
 * - reaps every zombie re-parented to it (waitpid(-1) loop on SIGCHLD);
 * - exits 0 on SIGTERM or SIGINT;
 * - otherwise sleeps in sigwaitinfo(), costing a few KiB of RSS.
 *
 * Signals are blocked and taken synchronously: as a pid-namespace init, signals with a default
 * disposition would be ignored by the kernel, blocked ones are still delivered to sigwaitinfo.
 * Built statically (gcc -static -Os) so it needs nothing from the sandbox's rootfs.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void reap(void) {
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigprocmask(SIG_BLOCK, &set, NULL);
    reap();
    for (;;) {
        int sig = sigwaitinfo(&set, NULL);
        if (sig == SIGTERM || sig == SIGINT) {
            reap();
            return 0;
        }
        if (sig == SIGCHLD) {
            reap();
        }
    }
}

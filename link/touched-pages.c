/*
 * touched-pages.so: preloaded into the provisioner by link/train.py's
 * second pass, it records which pages of the executable's code run, at
 * full speed and on the real CPU (callgrind, the first pass, runs one thread
 * at a time on an emulated CPU, so it misses slow paths that need contention
 * and code chosen by CPU features).
 *
 * At start-up it makes the executable's code inaccessible; the first
 * instruction fetched from each page faults, and the handler makes that one
 * page executable again. The pages still inaccessible at the end never ran:
 * /proc/PID/maps lists the executable's r-x ranges, which are the pages that
 * did.
 *
 * For training only: it replaces Rust's stack-overflow handler (Rust keeps a
 * SIGSEGV handler it finds installed).
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static uintptr_t text_lo, text_hi;

static void on_fault(int sig, siginfo_t *info, void *ctx)
{
    (void)ctx;
    uintptr_t a = (uintptr_t)info->si_addr;
    if (sig == SIGSEGV && a >= text_lo && a < text_hi) {
        uintptr_t page = a & ~(uintptr_t)4095;
        if (mprotect((void *)page, 4096, PROT_READ | PROT_EXEC) == 0)
            return;
    }
    /* Not ours: let the fault happen again with the default action. */
    signal(sig, SIG_DFL);
}

__attribute__((constructor)) static void touched_pages_init(void)
{
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return;
    exe[n] = 0;
    FILE *maps = fopen("/proc/self/maps", "r");
    if (!maps)
        return;
    char line[4352];
    while (fgets(line, sizeof line, maps)) {
        unsigned long lo, hi;
        char perm[5], path[4096] = "";
        if (sscanf(line, "%lx-%lx %4s %*s %*s %*s %4095s", &lo, &hi, perm, path) == 4 &&
            strcmp(perm, "r-xp") == 0 && strcmp(path, exe) == 0) {
            text_lo = lo;
            text_hi = hi;
        }
    }
    fclose(maps);
    if (!text_lo)
        return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, NULL) != 0)
        return;
    mprotect((void *)text_lo, text_hi - text_lo, PROT_NONE);
}

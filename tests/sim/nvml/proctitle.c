/*
 * setproctitle() look-alike, as SGLang ("sglang::scheduler_TP0") and vLLM
 * ("VLLM::Worker_TP1") use through the setproctitle package: the process
 * rewrites its own argv area, so /proc/PID/cmdline (and psutil's cmdline(),
 * ps, pgrep -f) no longer mention python at all; comm gets the first 15
 * characters through PR_SET_NAME.
 *
 * The kernel returns the argv area verbatim unless its last byte is not NUL,
 * in which case it returns the string at its start up to the first NUL
 * ("setproctitle mode", fs/proc/base.c get_mm_proctitle). We write the title,
 * a NUL, and pad the rest of the area with spaces so that the last byte is not
 * NUL: /proc/PID/cmdline then reads exactly "<title>\0", one argument.
 */
#define _GNU_SOURCE
#include "worker.h"

#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>

static char *area;
static size_t area_len;

/* Remember the argv area (it must be contiguous, as the kernel lays it out). */
void wk_proctitle_init(int argc, char **argv)
{
    char *end;
    if (argc < 1)
        return;
    end = argv[0];
    for (int i = 0; i < argc; i++) {
        if (argv[i] != end)
            return; /* not contiguous: leave it alone */
        end = argv[i] + strlen(argv[i]) + 1;
    }
    area = argv[0];
    area_len = (size_t)(end - argv[0]);
}

/* `title` must not point into the argv area (copy it first). */
void wk_set_proctitle(const char *title)
{
    char comm[16];
    size_t n = strlen(title);

    snprintf(comm, sizeof comm, "%s", title);
    prctl(PR_SET_NAME, comm, 0, 0, 0);
    if (!area || area_len < 3)
        return;
    if (n > area_len - 2)
        n = area_len - 2;
    memcpy(area, title, n);
    area[n] = '\0';
    memset(area + n + 1, ' ', area_len - n - 1);
}

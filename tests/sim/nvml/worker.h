/*
 * gpusim-worker: a fake CUDA process (or a management client) for the
 * simulated node. See worker.c for the options.
 */
#ifndef GPUSIM_WORKER_H
#define GPUSIM_WORKER_H

#include <stddef.h>

#define WK_EXIT_USAGE 2
#define WK_EXIT_DRIVER 3 /* registration failed: OOM, lost GPU, daemon absent */

/* worker_driver.c: device files and the driver daemon protocol */
int wk_gpu_minor(const char *state, unsigned gpu);
int wk_gpu_count(const char *state);
int wk_open_device(const char *state, const char *name, int map);
int wk_create_context(const char *state, unsigned gpu, unsigned long long mib, const char *kind, char *err, size_t errlen);
int wk_open_teardown(const char *state, const unsigned *ids, int n);
const char *wk_dev_dir(const char *state);
int wk_request(const char *state, const char *request, char *reply, size_t replylen, char *err, size_t errlen);
extern char wk_last_code[32]; /* the daemon's word for the last failure: OOM, BUSY, ECC, NOTREADY, LOST, ... */

/* proctitle.c: setproctitle() look-alike */
void wk_proctitle_init(int argc, char **argv);
void wk_set_proctitle(const char *title);

#endif

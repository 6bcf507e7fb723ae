/*
 * Internal interface of the simulated libnvidia-ml.so.1 (gpusim).
 *
 * The library is a thin, stateless-ish view over a "node" kept on disk by the
 * Python side (gpusim) and its driver daemon:
 *
 *   $GPUSIM_STATE/node.conf     description + faults, flat key=value
 *   $GPUSIM_STATE/dev/nvidia*   the "device files" (regular files)
 *   $GPUSIM_STATE/ctx/<id>.ctx  one record per GPU context (written by the daemon)
 *   $GPUSIM_STATE/driver.lock   OFD-locked by the daemon while it runs
 *
 * Every query recomputes its answer from those files, so that the library and
 * the daemon never need to talk to each other.
 */
#ifndef GPUSIM_SIM_H
#define GPUSIM_SIM_H

#include <limits.h>
#include <pthread.h>

/* Both the unversioned (v1) and the versioned entry points are defined with
 * the header's own prototypes, which needs the header's compatibility mode. */
#ifndef NVML_NO_UNVERSIONED_FUNC_DEFS
#error "compile with -DNVML_NO_UNVERSIONED_FUNC_DEFS"
#endif
#include <nvml.h>

#define SIM_MAX_GPUS 64
#define SIM_MAX_LEVELS 32 /* kernel limit for PID namespace nesting is 32 */
#define SIM_MAX_CTX 1024
#define SIM_NVLINK_MAX 36     /* NVML_NVLINK_MAX_LINKS of this nvml.h */
#define SIM_NVLINK_COUNTERS 4 /* replay, recovery, CRC flit, CRC data (nvmlNvLinkErrorCounter_t 0..3) */

/* One simulated GPU, as described in node.conf. */
typedef struct sim_gpu {
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE]; /* "00000000:18:00.0" */
    unsigned domain, bus, dev;
    unsigned minor;
    unsigned pci_device_id, pci_subsystem_id;
    unsigned long long total_mib, reserved_mib, orphan_mib;
    unsigned mig_mode;
    unsigned recovery_action;
    int lost;
    int timeout; /* this GPU is selected by the timeout fault */
    int hang;    /* this GPU is selected by the hang fault */
    /* Health (issue 12): what the GPU supports, as its model does (features), and its state. */
    unsigned features; /* SIM_FEAT_* */
    unsigned persistence;
    unsigned mig_pending;
    unsigned remap_corr, remap_unc, remap_pending, remap_failure;
    unsigned retired_sbe, retired_dbe, retired_pending;
    unsigned long long ecc_volatile_unc;
    unsigned fabric_state;  /* nvmlGpuFabricState_t */
    unsigned fabric_status; /* nvmlReturn_t of the fabric setup */
    unsigned inforom_corrupt;
    /* Links, clocks and temperature (issue 39): what a tp=N start needs of its GPUs together. */
    unsigned nvlinks;                 /* NVLink links the GPU has (0: none, NOT_SUPPORTED) */
    unsigned nvlink_version;          /* nvmlNvlinkVersion_t */
    unsigned nvlink_remote;           /* nvmlIntNvLinkDeviceType_t of every link's far end */
    unsigned long long nvlink_down;   /* bit per link: inactive */
    unsigned long long nvlink_err[SIM_NVLINK_COUNTERS][SIM_NVLINK_MAX]; /* nvmlNvLinkErrorCounter_t x link */
    unsigned pcie_gen_gpu_max;        /* what the GPU supports (nvmlDeviceGetGpuMaxPcieLinkGeneration) */
    unsigned pcie_gen_max;            /* what the GPU and the slot allow (nvmlDeviceGetMaxPcieLinkGeneration) */
    unsigned pcie_gen;                /* what the link trained at, when the GPU is not idle */
    unsigned pcie_gen_idle;           /* what an idle GPU lowers it to to save power (0: it does not) */
    unsigned pcie_width_max, pcie_width;
    unsigned long long clocks_event_reasons; /* nvmlClocksEventReason* bits, GpuIdle added while idle */
    unsigned temperature;             /* GPU die, C */
    unsigned temp_limit;              /* T.Limit: the maximum operating temperature, C */
} sim_gpu_t;


/* What a GPU model answers (the rest is NVML_ERROR_NOT_SUPPORTED, as on the real one). */
#define SIM_FEAT_ECC 1u     /* ECC counters (data-centre GPUs) */
#define SIM_FEAT_REMAP 2u   /* row remapping (Ampere and later data-centre GPUs) */
#define SIM_FEAT_RETIRED 4u /* dynamic page retirement (Kepler to Volta data-centre GPUs) */
#define SIM_FEAT_FABRIC 8u  /* NVLink fabric state (Hopper and later) */
#define SIM_FEAT_MIG 16u    /* MIG (A100, H100, H200, ...) */

/* The whole node description (node.conf). */
typedef struct sim_config {
    char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    char nvml_version[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE];
    int cuda_driver_version;
    unsigned gpu_count;
    sim_gpu_t gpus[SIM_MAX_GPUS];
    /* faults */
    nvmlReturn_t init_error;
    int legacy_pids;
    int memory_v2_unsupported;
    int memory_na;
    int process_api; /* newest process entry point that exists: 1, 2 or 3 */
    unsigned long long context_overhead_mib; /* device memory per live context no process is charged */
    char phantom_pids[2048]; /* "gpu:pid,gpu:pid": entries the compute list reports that hold nothing */
    char timeout_functions[2048]; /* ",name,name," (leading/trailing comma for matching) */
    int timeout_delay_ms;
    char hang_functions[2048]; /* ",name,name,": these never return (a driver hang) */
    char p2p_unsupported[2048]; /* "a-b,c-d": pairs without peer access (NVML's P2P status and CUDA's answer) */
} sim_config_t;

/* nvml.h only forward-declares this; a handle points into sim_devices[]. */
struct nvmlDevice_st {
    unsigned index;
    int fd; /* dev/nvidia<minor>, opened when the handle is first handed out */
};

/* One context record (ctx/<id>.ctx) that still counts. */
typedef struct sim_ctx {
    unsigned id;
    unsigned gpu;
    int kind; /* 0 compute, 1 graphics, 2 mps: the NVML process list that shows it */
    unsigned long long mib;
    int nlevels;
    unsigned long long level_ns[SIM_MAX_LEVELS]; /* pid-namespace inode, outermost first */
    unsigned level_pid[SIM_MAX_LEVELS];
} sim_ctx_t;

/* ---- global library state (core.c), protected by sim_mutex ---- */
extern pthread_mutex_t sim_mutex;
extern unsigned sim_refcount;
extern sim_config_t sim_cfg;
extern char sim_state[PATH_MAX];
extern struct nvmlDevice_st sim_devices[SIM_MAX_GPUS];
extern unsigned long long sim_caller_pidns; /* inode of the caller's PID namespace */
extern char sim_dev_dir[PATH_MAX];           /* $GPUSIM_DEV_DIR, else $GPUSIM_STATE/dev */

/* ---- config.c ---- */
int sim_config_load(const char *state_dir, sim_config_t *cfg);
void sim_config_refresh(void);
void sim_config_forget(void);
nvmlReturn_t sim_error_from_name(const char *name);

/* Recovery-action field (230) exists from driver R550 on. */
int sim_recovery_action_supported(void);

/* ---- errors (core.c) ---- */
const char *sim_error_string(nvmlReturn_t rc);

/* ---- state.c ---- */
int sim_ctx_scan(unsigned gpu, sim_ctx_t *out, int max);
unsigned long long sim_ctx_used_mib(unsigned gpu);
int sim_ctx_visible_pid(const sim_ctx_t *ctx, unsigned *pid);
int sim_gpu_busy(unsigned gpu); /* a live context on it: the GPU leaves its idle state */
int sim_pair_listed(const char *list, unsigned a, unsigned b); /* "a-b,c-d" names the pair, either order */
long long sim_now_ns(void);

/* ---- entry/exit helpers (core.c) ----
 * Every implemented entry point starts with sim_enter() or sim_enter_dev(),
 * which take sim_mutex, check initialisation, pick up a changed node.conf and
 * apply the per-function faults. On a non-SUCCESS result the mutex is already
 * released; on SUCCESS the caller must finish with sim_leave(rc). */
nvmlReturn_t sim_enter(const char *fn);
nvmlReturn_t sim_enter_dev(const char *fn, nvmlDevice_t device, const sim_gpu_t **gpu);
nvmlReturn_t sim_leave(nvmlReturn_t rc);
int sim_device_open(unsigned index);
int sim_node_is_drivers(const char *name);
unsigned sim_visible(unsigned *map);
nvmlReturn_t sim_copy_string(char *dst, unsigned length, const char *src);

/* Result of every generated (unimplemented) entry point. */
nvmlReturn_t sim_stub_result(void);

#endif

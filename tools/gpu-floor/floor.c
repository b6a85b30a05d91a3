/* GPU small-message floors on one machine, plain CUDA driver calls only (no rucx).
 *
 *   floor single SIZE ITERS      one process: one async copy + event poll (H2D, D2H, D2D),
 *                                and a synchronous pageable cuMemcpyHtoD, per iteration
 *   floor pingpong SIZE ITERS    two processes on GPU 0 (fork, each its own context): each
 *                                one-way is one cuMemcpyDtoDAsync from the sender's buffer into
 *                                the receiver's buffer through a cuda_ipc mapping (opened once),
 *                                an event polled until done, then a flag in shared memory the
 *                                receiver spins on. Also the same with only one rank copying
 *                                (the other echoes the flag) and with no copy at all.
 * Prints median / p10 / p90 one-way microseconds.
 * Build: nvcc -O2 -o floor floor.c -lcuda   (or cc ... -I/usr/local/cuda/include -lcuda) */
#define _GNU_SOURCE
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_; \
  cuGetErrorString(r_, &s_); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); \
  exit(1); } } while (0)

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static void report(const char *what, double *v, int n, double scale) {
  for (int i = 0; i < n; i++) v[i] *= scale;
  qsort(v, n, sizeof(double), cmpd);
  printf("%-58s p50 %8.2f us  p10 %8.2f  p90 %8.2f\n", what, v[n / 2], v[n / 10], v[n * 9 / 10]);
  fflush(stdout);
}
static void wait_ev(CUevent e) {
  CUresult r;
  while ((r = cuEventQuery(e)) == CUDA_ERROR_NOT_READY) {}
  CK(r);
}

static void single(size_t size, int iters) {
  CUdevice d; CUcontext c; CUstream s; CUevent e;
  CUdeviceptr dev, dev2; void *pin; void *pg = malloc(size);
  memset(pg, 1, size);
  CK(cuInit(0)); CK(cuDeviceGet(&d, 0)); CK(cuDevicePrimaryCtxRetain(&c, d)); CK(cuCtxSetCurrent(c));
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  CK(cuMemAlloc(&dev, size)); CK(cuMemAlloc(&dev2, size)); CK(cuMemHostAlloc(&pin, size, 0));
  double *v = malloc(sizeof(double) * iters);
  char name[128];
  for (int k = 0; k < 5; k++) {
    for (int i = -100; i < iters; i++) {
      double t0 = now_us();
      switch (k) {
      case 0: CK(cuMemcpyHtoDAsync(dev, pin, size, s)); break;
      case 1: CK(cuMemcpyDtoHAsync(pin, dev, size, s)); break;
      case 2: CK(cuMemcpyDtoDAsync(dev2, dev, size, s)); break;
      case 3: CK(cuMemcpyHtoDAsync(dev, pg, size, s)); break;
      case 4: CK(cuMemcpyHtoD(dev, pg, size)); break;
      }
      if (k != 4) { CK(cuEventRecord(e, s)); wait_ev(e); }
      if (i >= 0) v[i] = now_us() - t0;
    }
    const char *names[] = {"pinned H2D async + event poll", "D2H to pinned async + event poll",
                           "D2D async + event poll", "pageable H2D async + event poll",
                           "pageable H2D sync cuMemcpyHtoD"};
    snprintf(name, sizeof name, "single process %zu B: %s", size, names[k]);
    report(name, v, iters, 1.0);
  }
}

struct shared {
  volatile uint64_t flag[2];   /* flag[r]: the last round rank r saw arrive */
  volatile int ready[2];
  CUipcMemHandle h[2];
  unsigned char bytes[1 << 16]; /* an eager slot in shared (pageable) memory */
};

static void rank_main(int r, struct shared *sh, size_t size, int iters) {
  CUdevice d; CUcontext c; CUstream s; CUevent e; CUdeviceptr mine, peer;
  CK(cuInit(0)); CK(cuDeviceGet(&d, 0)); CK(cuDevicePrimaryCtxRetain(&c, d)); CK(cuCtxSetCurrent(c));
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  CK(cuMemAlloc(&mine, 2 << 20));
  CK(cuMemsetD8(mine, (unsigned char)r, 2 << 20));
  CK(cuCtxSynchronize());
  CK(cuIpcGetMemHandle(&sh->h[r], mine));
  __sync_synchronize();
  sh->ready[r] = 1;
  while (!sh->ready[1 - r]) {}
  __sync_synchronize();
  CK(cuIpcOpenMemHandle(&peer, sh->h[1 - r], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  double *v = malloc(sizeof(double) * iters);
  void *pin;
  CK(cuMemHostAlloc(&pin, 1 << 16, 0));
  /* mode 0: both copy; 1: only rank 0 copies; 2: nobody copies (flags only); 3: two copies a
   * one-way as a bounce eager does (sender D2H into pinned memory + event poll, CPU copy into
   * the shared slot; receiver H2D out of the shared slot + event poll) */
  const char *names[] = {"both ranks copy", "rank 0 copies, rank 1 echoes", "no copy (flags only)",
                         "bounce: D2H + H2D per one-way"};
  uint64_t round = 0;
  for (int mode = 0; mode < 4; mode++) {
    for (int i = -200; i < iters; i++) {
      double t0 = now_us();
      for (int leg = 0; leg < 2; leg++) {
        round++;
        int sender = leg;  /* rank 0 sends first, rank 1 answers */
        if (r == sender) {
          int copy = mode == 0 || (mode == 1 && r == 0);
          if (mode == 3) {
            CK(cuMemcpyDtoHAsync(pin, mine, size, s));
            CK(cuEventRecord(e, s));
            wait_ev(e);
            memcpy((void *)sh->bytes, pin, size);
          } else if (copy) {
            CK(cuMemcpyDtoDAsync(peer, mine, size, s));
            CK(cuEventRecord(e, s));
            wait_ev(e);
          }
          __sync_synchronize();
          sh->flag[1 - r] = round;
        } else {
          while (sh->flag[r] != round) {}
          __sync_synchronize();
          if (mode == 3) {
            CK(cuMemcpyHtoDAsync(mine, (const void *)sh->bytes, size, s));
            CK(cuEventRecord(e, s));
            wait_ev(e);
          }
        }
      }
      if (i >= 0) v[i] = now_us() - t0;
    }
    if (r == 0) {
      char name[128];
      snprintf(name, sizeof name, "two processes GPU 0 %zu B one-way: %s", size, names[mode]);
      report(name, v, iters, 0.5);
    }
  }
  CK(cuIpcCloseMemHandle(peer));
}

static void pingpong(size_t size, int iters) {
  struct shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset((void *)sh, 0, sizeof *sh);
  pid_t p[2];
  for (int r = 0; r < 2; r++) {
    p[r] = fork();
    if (p[r] == 0) { rank_main(r, sh, size, iters); _exit(0); }
  }
  int bad = 0;
  for (int r = 0; r < 2; r++) { int st; waitpid(p[r], &st, 0); bad |= !WIFEXITED(st) || WEXITSTATUS(st); }
  if (bad) { fprintf(stderr, "a rank failed\n"); exit(1); }
}

int main(int argc, char **argv) {
  if (argc < 2) { fprintf(stderr, "usage: floor single|pingpong [SIZE] [ITERS]\n"); return 2; }
  size_t size = argc > 2 ? strtoull(argv[2], 0, 0) : 8;
  int iters = argc > 3 ? atoi(argv[3]) : 2000;
  if (!strcmp(argv[1], "single")) single(size, iters);
  else if (!strcmp(argv[1], "pingpong")) pingpong(size, iters);
  else { fprintf(stderr, "unknown mode %s\n", argv[1]); return 2; }
  return 0;
}

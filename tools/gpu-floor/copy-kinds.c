/* How a small copy on GPU 0 can run and how its end can be seen, one process, plain CUDA driver
 * calls (no rucx): cuMemcpy*Async or a one-block copy kernel (PTX, as rucx's copy kernel), its
 * end polled through an event (cuEventQuery) or through a word in pinned host memory that the
 * kernel or cuStreamWriteValue64 writes. Prints p50 / p10 / p90 microseconds per copy and the
 * time inside the queuing call(s).
 *
 *   copy-kinds SIZE ITERS
 * Build: nvcc -O2 -o copy-kinds copy-kinds.c -lcuda */
#define _GNU_SOURCE
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_; \
  cuGetErrorString(r_, &s_); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); \
  exit(1); } } while (0)
static double now_us(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
static int cmpd(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }
static void report(const char *what, double *v, double *c, int n) {
  qsort(v, n, sizeof(double), cmpd); qsort(c, n, sizeof(double), cmpd);
  printf("%-52s p50 %7.2f us p10 %7.2f p90 %7.2f | in call p50 %6.2f\n", what, v[n/2], v[n/10], v[n*9/10], c[n/2]);
  fflush(stdout);
}
static const char *ptx =
".version 7.0\n.target sm_70\n.address_size 64\n"
".visible .entry kcopy(.param .u64 pd, .param .u64 ps, .param .u64 pn, .param .u64 pf, .param .u64 pq)\n{\n"
" .reg .pred %p<3>;\n .reg .b16 %h<2>;\n .reg .b32 %r<6>;\n .reg .b64 %rd<12>;\n"
" ld.param.u64 %rd1, [pd];\n ld.param.u64 %rd2, [ps];\n ld.param.u64 %rd3, [pn];\n ld.param.u64 %rd4, [pf];\n ld.param.u64 %rd10, [pq];\n"
" mov.u32 %r1, %tid.x;\n mov.u32 %r2, %ntid.x;\n mov.u32 %r3, %ctaid.x;\n mov.u32 %r4, %nctaid.x;\n"
" mul.wide.u32 %rd5, %r3, %r2;\n cvt.u64.u32 %rd6, %r1;\n add.u64 %rd5, %rd5, %rd6;\n mul.wide.u32 %rd7, %r4, %r2;\n"
"LOOP:\n setp.ge.u64 %p1, %rd5, %rd3;\n @%p1 bra DONE;\n add.u64 %rd8, %rd2, %rd5;\n ld.global.u8 %h1, [%rd8];\n"
" add.u64 %rd9, %rd1, %rd5;\n st.global.u8 [%rd9], %h1;\n add.u64 %rd5, %rd5, %rd7;\n bra LOOP;\n"
"DONE:\n setp.eq.u64 %p2, %rd4, 0;\n @%p2 bra END;\n bar.sync 0;\n setp.ne.u32 %p2, %r1, 0;\n @%p2 bra END;\n"
" membar.sys;\n st.volatile.global.u64 [%rd4], %rd10;\nEND:\n ret;\n}\n";

int main(int argc, char **argv) {
  size_t size = argc > 1 ? strtoull(argv[1], 0, 0) : 8;
  int iters = argc > 2 ? atoi(argv[2]) : 2000;
  CUdevice d; CUcontext c; CUstream s; CUevent e; CUmodule m; CUfunction f;
  CUdeviceptr dev, dev2, pind; void *pin; volatile uint64_t *flag; CUdeviceptr flagd;
  CK(cuInit(0)); CK(cuDeviceGet(&d, 0)); CK(cuDevicePrimaryCtxRetain(&c, d)); CK(cuCtxSetCurrent(c));
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  double t0 = now_us();
  char log[8192] = {0};
  CUjit_option o[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void *ov[2] = {log, (void *)(uintptr_t)sizeof log};
  CUresult lr = cuModuleLoadDataEx(&m, ptx, 2, o, ov);
  if (lr != CUDA_SUCCESS) { fprintf(stderr, "load: %d %s\n", lr, log); return 1; }
  CK(cuModuleGetFunction(&f, m, "kcopy"));
  printf("module load (JIT) %.1f us\n", now_us() - t0);
  CK(cuMemAlloc(&dev, size)); CK(cuMemAlloc(&dev2, size));
  CK(cuMemHostAlloc(&pin, size, CU_MEMHOSTALLOC_DEVICEMAP)); CK(cuMemHostGetDevicePointer(&pind, pin, 0));
  CK(cuMemHostAlloc((void **)&flag, 64, CU_MEMHOSTALLOC_DEVICEMAP)); CK(cuMemHostGetDevicePointer(&flagd, (void *)flag, 0));
  memset(pin, 7, size); CK(cuMemsetD8(dev, 3, size)); CK(cuCtxSynchronize());
  double *v = malloc(sizeof(double) * iters), *cc = malloc(sizeof(double) * iters);
  const char *names[] = {"memcpy D2D + event", "kernel D2D + event", "kernel D2D + host flag",
    "memcpy H2D pinned + event", "kernel H2D (reads pinned) + host flag",
    "memcpy D2H pinned + event", "kernel D2H (writes pinned) + host flag",
    "kernel D2D + event, 1 thread", "launch only (n=0) + host flag",
    "memcpy D2D + writeValue64 flag", "memcpy H2D pinned + writeValue64 flag",
    "memcpy D2H pinned + writeValue64 flag", "writeValue64 flag only", "2x memcpy D2D + writeValue64 flag"};
  uint64_t seq = 0;
  int a1=0,a2=0; CK(cuDeviceGetAttribute(&a1, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, d));
  printf("64-bit stream mem ops: %d\n", a1); (void)a2;
  for (int k = 0; k < 14; k++) {
    for (int i = -200; i < iters; i++) {
      double a = now_us(), b;
      CUdeviceptr dst = dev2, src = dev; uint64_t n = size, fl = 0, q = ++seq;
      int useflag = (k == 2 || k == 4 || k == 6 || k == 8 || k >= 9);
      if (useflag) fl = flagd;
      if (k == 4) src = pind;
      if (k == 6) dst = pind;
      if (k == 8) n = 0;
      void *args[] = {&dst, &src, &n, &fl, &q};
      unsigned th = k == 7 ? 1 : (size < 256 ? 32 : 256);
      switch (k) {
      case 0: CK(cuMemcpyDtoDAsync(dev2, dev, size, s)); break;
      case 3: CK(cuMemcpyHtoDAsync(dev, pin, size, s)); break;
      case 5: CK(cuMemcpyDtoHAsync(pin, dev, size, s)); break;
      case 9: CK(cuMemcpyDtoDAsync(dev2, dev, size, s)); CK(cuStreamWriteValue64(s, flagd, q, 0)); break;
      case 10: CK(cuMemcpyHtoDAsync(dev, pin, size, s)); CK(cuStreamWriteValue64(s, flagd, q, 0)); break;
      case 11: CK(cuMemcpyDtoHAsync(pin, dev, size, s)); CK(cuStreamWriteValue64(s, flagd, q, 0)); break;
      case 12: CK(cuStreamWriteValue64(s, flagd, q, 0)); break;
      case 13: CK(cuMemcpyDtoDAsync(dev2, dev, size, s)); CK(cuMemcpyDtoDAsync(dev, dev2, size, s)); CK(cuStreamWriteValue64(s, flagd, q, 0)); break;
      default: CK(cuLaunchKernel(f, 1, 1, 1, th, 1, 1, 0, s, args, NULL)); break;
      }
      b = now_us();
      if (useflag) { while (*flag != q) {} }
      else { CK(cuEventRecord(e, s)); CUresult r; while ((r = cuEventQuery(e)) == CUDA_ERROR_NOT_READY) {} CK(r); }
      if (i >= 0) { v[i] = now_us() - a; cc[i] = b - a; }
    }
    char name[128]; snprintf(name, sizeof name, "%zu B: %s", size, names[k]);
    report(name, v, cc, iters);
  }
  /* verify kernel copies */
  CK(cuMemsetD8(dev, 0x5a, size)); CK(cuMemsetD8(dev2, 0, size)); CK(cuCtxSynchronize());
  { CUdeviceptr dst = dev2, src = dev; uint64_t n = size, fl = 0, q = 0; void *args[] = {&dst, &src, &n, &fl, &q};
    CK(cuLaunchKernel(f, 1, 1, 1, 256, 1, 1, 0, s, args, NULL)); CK(cuStreamSynchronize(s)); }
  unsigned char *h = malloc(size); CK(cuMemcpyDtoH(h, dev2, size));
  for (size_t i = 0; i < size; i++) if (h[i] != 0x5a) { printf("VERIFY FAILED at %zu\n", i); return 1; }
  printf("verify ok\n");
  return 0;
}

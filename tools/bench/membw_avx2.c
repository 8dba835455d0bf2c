// Sustained read bandwidth for CPUs without AVX-512: the peers' micro/membw.c (shared/bench/peers)
// with 256-bit loads. Each thread sums its slice of a large array with eight independent AVX adds
// per 256 bytes. usage: membw_avx2 [GiB=2] [reps=10]   (thread count via OMP_NUM_THREADS)
// Build: gcc -O3 -mavx2 -fopenmp membw_avx2.c -o membw_avx2  (tools/bench/bench.py does this when needed)
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

static int cmpd(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv) {
  double gib = argc > 1 ? atof(argv[1]) : 2.0;
  int reps = argc > 2 ? atoi(argv[2]) : 10;
  size_t bytes = (size_t)(gib * (1ull << 30)) & ~(size_t)((2 << 20) - 1);
  size_t n = bytes / sizeof(float);
  float *a = aligned_alloc(2 << 20, bytes);
  if (!a || reps < 1) return 1;
  madvise(a, bytes, MADV_HUGEPAGE);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) a[i] = (float)(i & 1023) * 1e-3f;  // first touch, per-thread pages
  double *gbs = malloc(sizeof(double) * reps);
  volatile float sink = 0;
  for (int r = 0; r < reps; r++) {
    double t0 = omp_get_wtime();
    float tot = 0;
#pragma omp parallel reduction(+ : tot)
    {
      int tid = omp_get_thread_num(), T = omp_get_num_threads();
      size_t chunk = (n / T) & ~(size_t)63;
      const float *p = a + (size_t)tid * chunk;
      size_t m = (tid == T - 1) ? n - (size_t)tid * chunk : chunk;
      __m256 s[8];
      for (int j = 0; j < 8; j++) s[j] = _mm256_setzero_ps();
      size_t i = 0;
      for (; i + 64 <= m; i += 64)
        for (int j = 0; j < 8; j++) s[j] = _mm256_add_ps(s[j], _mm256_load_ps(p + i + 8 * j));
      float t = 0, lanes[8];
      for (; i < m; i++) t += p[i];
      for (int j = 1; j < 8; j++) s[0] = _mm256_add_ps(s[0], s[j]);
      _mm256_storeu_ps(lanes, s[0]);
      for (int j = 0; j < 8; j++) t += lanes[j];
      tot += t;
    }
    double dt = omp_get_wtime() - t0;
    sink += tot;
    gbs[r] = bytes / dt / 1e9;
  }
  qsort(gbs, reps, sizeof(double), cmpd);
  printf("threads=%d size_GiB=%.2f read_GBps_median=%.2f best=%.2f worst=%.2f\n", omp_get_max_threads(), gib,
         gbs[reps / 2], gbs[reps - 1], gbs[0]);
  return 0;
}

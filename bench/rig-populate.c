/* The limit for bench/rig-memory.sh's memboot modes: how long the L1 itself
 * takes to populate MIB MiB of anonymous memory, as a VMM committing guest
 * memory would (huge pages advised, MADV_POPULATE_WRITE, 64 MiB units cut at
 * 2 MiB boundaries, on THREADS threads). Prints the milliseconds from mmap to
 * the last thread done; the unmap is not counted.
 * Static, no input but its arguments: `rig-populate MIB THREADS`. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#define UNIT (64ULL << 20)

static char *base;
static uint64_t len;
static atomic_uint_fast64_t next;
static atomic_int failed;

static void *worker(void *arg) {
  (void)arg;
  for (;;) {
    uint64_t at = atomic_fetch_add(&next, UNIT);
    if (at >= len) return 0;
    uint64_t n = len - at < UNIT ? len - at : UNIT;
    if (madvise(base + at, n, MADV_POPULATE_WRITE) != 0) atomic_store(&failed, 1);
  }
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s MIB THREADS\n", argv[0]);
    return 2;
  }
  len = strtoull(argv[1], 0, 10) << 20;
  int threads = atoi(argv[2]);
  if (threads < 1 || threads > 64) threads = 1;
  double t0 = now_ms();
  /* 2 MiB-aligned, so a unit boundary is a huge-page boundary. */
  char *m = mmap(0, len + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  base = (char *)(((uintptr_t)m + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
  madvise(base, len, MADV_HUGEPAGE);
  pthread_t t[64];
  for (int i = 0; i < threads; i++) pthread_create(&t[i], 0, worker, 0);
  for (int i = 0; i < threads; i++) pthread_join(t[i], 0);
  double t1 = now_ms();
  if (atomic_load(&failed)) {
    perror("madvise(MADV_POPULATE_WRITE)");
    return 1;
  }
  printf("%.0f\n", t1 - t0);
  return 0;
}

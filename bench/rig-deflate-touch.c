/* The L2 guest's page checker for bench/rig-deflate.sh: maps MIB MiB of
 * anonymous memory (populated, so the pages come from the free lists the
 * deflate just refilled), writes every 8-byte word a value derived from its
 * index and the cycle, sleeps a second (a late discard of a page by the host
 * would land in it), reads every word back and prints one line:
 *   TOUCH cycle=C mib=M bad=WORDS first_bad=OFFSET sum=HEX
 * bad=0 and the sum expected for (C, M) mean every page held what was
 * written. Static, no input but its arguments: `rig-deflate-touch MIB CYCLE`. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static uint64_t word(uint64_t i, uint64_t cycle) {
  return (i + 1) * 0x9e3779b97f4a7c15ULL ^ (cycle << 56 | cycle);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s MIB CYCLE\n", argv[0]);
    return 2;
  }
  uint64_t mib = strtoull(argv[1], 0, 10), cycle = strtoull(argv[2], 0, 10);
  uint64_t words = mib << 17;
  volatile uint64_t *m = mmap(0, mib << 20, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (m == MAP_FAILED) {
    printf("TOUCH cycle=%llu mib=%llu nomem\n", (unsigned long long)cycle,
           (unsigned long long)mib);
    return 1;
  }
  for (uint64_t i = 0; i < words; i++) m[i] = word(i, cycle);
  struct timespec s = {1, 0};
  nanosleep(&s, 0);
  uint64_t bad = 0, first = ~0ULL, sum = 0;
  for (uint64_t i = 0; i < words; i++) {
    uint64_t v = m[i];
    sum += v;
    if (v != word(i, cycle)) {
      if (!bad) first = i * 8;
      bad++;
    }
  }
  printf("TOUCH cycle=%llu mib=%llu bad=%llu first_bad=%lld sum=%016llx\n",
         (unsigned long long)cycle, (unsigned long long)mib,
         (unsigned long long)bad, bad ? (long long)first : -1LL,
         (unsigned long long)sum);
  return bad ? 1 : 0;
}

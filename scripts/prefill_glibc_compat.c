/* Only for scripts/prefill-check.sh's standalone binary: the static libstdc++
   of the build machine (glibc 2.36) calls arc4random from std::random_device;
   defining it here keeps the binary runnable on glibc 2.35 (the GPU image). */
#include <stdint.h>
#include <stdlib.h>
#include <sys/random.h>
uint32_t arc4random(void) {
  uint32_t v = 0;
  if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) abort();
  return v;
}

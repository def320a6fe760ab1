// C++ tests of the native core, runnable without Python (ctest). Each test is a function
// registered in TESTS; a failed CHECK prints where and makes the run exit non-zero.
#include <cstdio>
#include <cstdlib>

#include "cflow/cpu.h"
#include "test_util.h"

int g_failures = 0;

static void test_isa_dispatch() {
  CHECK(cflow::isa_supported(cflow::Isa::Scalar));
  CHECK(cflow::isa_supported(cflow::best_isa()));
}

int main() {
  test_isa_dispatch();
  for (auto& t : test_registry()) t.second();
  std::printf("best ISA: %s; %d tests, %d failures\n", cflow::isa_name(cflow::best_isa()),
              (int)test_registry().size() + 1, g_failures);
  return g_failures ? 1 : 0;
}

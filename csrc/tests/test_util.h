#pragma once
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

extern int g_failures;

#define CHECK(cond)                                                         \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                         \
    }                                                                       \
  } while (0)

inline std::vector<std::pair<std::string, std::function<void()>>>& test_registry() {
  static std::vector<std::pair<std::string, std::function<void()>>> r;
  return r;
}

// TEST(name) { ... } registers a test function at static-initialisation time.
#define TEST(name)                                                              \
  static void name();                                                           \
  static const bool name##_registered = (test_registry().emplace_back(#name, name), true); \
  static void name()

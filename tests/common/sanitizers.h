#pragma once
// VERIFYD_UNDER_ASAN is 1 in an AddressSanitizer build, whichever compiler made it: gcc defines
// __SANITIZE_ADDRESS__, clang answers __has_feature(address_sanitizer). Tests of glibc's own heap
// skip there, since ASan's allocator replaces malloc.

#if defined(__SANITIZE_ADDRESS__)
#define VERIFYD_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define VERIFYD_UNDER_ASAN 1
#endif
#endif
#ifndef VERIFYD_UNDER_ASAN
#define VERIFYD_UNDER_ASAN 0
#endif

#pragma once
// The version CMake passes to the binaries (VERIFYD_VERSION) and the commit the build wrote
// (VERIFYD_GIT_COMMIT, in the build's generated verifyd_commit.h: verifyd_build_stamps() in the
// top-level CMakeLists.txt), with fallbacks for a build outside CMake.

#if __has_include("verifyd_commit.h")
#include "verifyd_commit.h"
#endif

#ifndef VERIFYD_VERSION
#define VERIFYD_VERSION "0.0.0"
#endif
#ifndef VERIFYD_GIT_COMMIT
#define VERIFYD_GIT_COMMIT "unknown"
#endif

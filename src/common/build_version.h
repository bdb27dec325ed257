#pragma once
// The version and commit CMake passes to the binaries (VERIFYD_VERSION, VERIFYD_GIT_COMMIT), with
// fallbacks for a build outside CMake.

#ifndef VERIFYD_VERSION
#define VERIFYD_VERSION "0.0.0"
#endif
#ifndef VERIFYD_GIT_COMMIT
#define VERIFYD_GIT_COMMIT "unknown"
#endif

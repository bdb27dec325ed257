# Writes OUT, a header defining VERIFYD_GIT_COMMIT: the checkout SRC's HEAD (12 digits), with
# "-dirty" when tracked files differ from it, or "unknown" outside a git checkout. Run at every
# build (the verifyd_commit_stamp target), it rewrites OUT only when the stamp changed, so that
# only what includes it recompiles, and only then.
#   cmake -DSRC=<checkout> -DOUT=<header> -P scripts/commit_stamp.cmake
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY "${SRC}"
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT commit)
  set(commit unknown)
else()
  execute_process(COMMAND git diff --quiet HEAD -- WORKING_DIRECTORY "${SRC}"
                  RESULT_VARIABLE dirty OUTPUT_QUIET ERROR_QUIET)
  if(NOT dirty EQUAL 0)
    set(commit "${commit}-dirty")
  endif()
endif()
set(content "#pragma once\n// Written at build time by scripts/commit_stamp.cmake.\n#define VERIFYD_GIT_COMMIT \"${commit}\"\n")
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL content)
  file(WRITE "${OUT}" "${content}")
endif()

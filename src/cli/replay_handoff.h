#pragma once
// `verifyctl replay ...` runs verifyd-replay with the same arguments: replay needs an engine (and
// CUDA), which verifyctl does not link.

#include <string>
#include <vector>

namespace verifyd::cli {

// Replaces this process with verifyd-replay (found beside this executable, else on PATH) and
// `args`; returns an exit code only when it could not be started, after saying why.
int HandOverToReplay(const std::vector<std::string>& args);

}  // namespace verifyd::cli

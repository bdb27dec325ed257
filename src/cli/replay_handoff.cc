#include "src/cli/replay_handoff.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>

namespace verifyd::cli {

int HandOverToReplay(const std::vector<std::string>& args) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::string program = "verifyd-replay";
  if (!ec) {
    const std::filesystem::path beside = self.parent_path() / "verifyd-replay";
    if (access(beside.c_str(), X_OK) == 0) program = beside.string();
  }
  std::vector<char*> argv;
  argv.push_back(program.data());
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  execvp(program.c_str(), argv.data());
  std::cerr << "verifyctl: replay: cannot start " << program << ": " << std::strerror(errno)
            << " (verifyd-replay is installed beside verifyctl)\n";
  return 127;
}

}  // namespace verifyd::cli

#pragma once
// Who a call comes from, as the transport verified it, and the one rule for when a peer may use
// what another peer registered or opened (regions, region sets, call channels, their doorbells and
// taps): --region_sharing.
//
// On a Unix socket the kernel gives verifyd the caller's uid and pid (SO_PEERCRED), which no
// process can claim for another. Over TCP, regions and channels are served only with
// --allow_region_tcp, by which the operator vouches for every TCP caller: they are one tenant.
// The client name a request carries is anyone's to choose and decides nothing.

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace verifyd {

struct Peer {
  std::optional<uint32_t> uid;  // the kernel's word, on a Unix socket
  std::optional<int> pid;       // likewise; nullopt when unknown (another pid namespace)
  bool tcp = false;             // a TCP caller (--allow_region_tcp vouches for all of them)
  bool daemon = false;          // verifyd itself
  std::string label;            // "uid 1000 pid 4242", "tcp client 'NAME'": logs, errors, counts

  static Peer Unix(uint32_t uid, std::optional<int> pid) {
    Peer p;
    p.uid = uid;
    p.pid = pid;
    p.label = pid ? absl::StrCat("uid ", uid, " pid ", *pid) : absl::StrCat("uid ", uid);
    return p;
  }
  static Peer Tcp(const std::string& client) {
    Peer p;
    p.tcp = true;
    p.label = absl::StrCat("tcp client '", client, "'");
    return p;
  }
  static Peer Daemon() {
    Peer p;
    p.daemon = true;
    p.label = "verifyd";
    return p;
  }
};

// What fair shares (streams, calls, the memory budget) count a Unix-socket peer by: its uid, all
// its processes together.
inline std::string UidShareKey(uint32_t uid) { return absl::StrCat("uid ", uid); }
// A channel's owner's key: its uid's, or none (counted against the ceiling only) without a uid.
inline std::string UidShareKey(const Peer& p) {
  return p.uid ? UidShareKey(*p.uid) : std::string();
}

// Who else may use, list, unregister or close what a peer registered or opened.
enum class Sharing {
  kProcess,  // the process that registered it, alone
  kUid,      // every process of its uid (the default: a serving stack's ranks share one uid)
  kAll,      // every peer that can reach the data socket (one trusted tenant)
};

inline const char* SharingName(Sharing s) {
  return s == Sharing::kProcess ? "process" : s == Sharing::kUid ? "uid" : "all";
}

inline absl::StatusOr<Sharing> ParseSharing(absl::string_view v) {
  if (v == "process") return Sharing::kProcess;
  if (v == "uid") return Sharing::kUid;
  if (v == "all") return Sharing::kAll;
  return absl::InvalidArgumentError(
      absl::StrCat("--region_sharing: '", v, "' is not one of process, uid, all"));
}

// Whether `caller` may use what `owner` registered or opened. A peer with neither a uid nor TCP
// (nobody verified) may use nothing.
inline bool MayUse(Sharing s, const Peer& owner, const Peer& caller) {
  if (caller.daemon || s == Sharing::kAll) return true;
  if (owner.tcp || caller.tcp) return owner.tcp && caller.tcp;
  if (!owner.uid || !caller.uid || *owner.uid != *caller.uid) return false;
  return s == Sharing::kUid || (owner.pid && caller.pid && *owner.pid == *caller.pid);
}

// Reports one refused use (`what`: "region 'pool'", "channel 'c'"; `resource`: "region" or
// "channel") for the metrics and the audit log.
struct Denial {
  const char* resource;
  std::string what;
  std::string action;  // "use", "unregister", "close"
  const Peer* caller;
  std::string owner;
};
using DenialObserver = std::function<void(const Denial&)>;

}  // namespace verifyd

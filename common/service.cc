#include "common/service.h"

#include <systemd/sd-daemon.h>

#include <cstdint>
#include <mutex>

namespace conveyor::service {

namespace {

std::mutex g_mu;
std::chrono::steady_clock::time_point g_last_ping{};
int64_t g_interval_us = -1;  // -1: not asked yet; 0: no watchdog

}  // namespace

void ready(const std::string& s) { sd_notifyf(0, "READY=1\nSTATUS=%s", s.c_str()); }
void status(const std::string& s) { sd_notifyf(0, "STATUS=%s", s.c_str()); }
void stopping() { sd_notify(0, "STOPPING=1"); }

void watchdog_tick() {
  std::lock_guard lk(g_mu);
  if (g_interval_us < 0) {
    uint64_t us = 0;
    g_interval_us = sd_watchdog_enabled(0, &us) > 0 ? int64_t(us) : 0;
  }
  if (g_interval_us == 0) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - g_last_ping < std::chrono::microseconds(g_interval_us / 2)) return;
  g_last_ping = now;
  sd_notify(0, "WATCHDOG=1");
}

}  // namespace conveyor::service

// The daemons' side of systemd's service protocol (sd_notify): READY once serving,
// STATUS lines, STOPPING on the way out, and WATCHDOG keep-alives at half the interval the
// unit's WatchdogSec= asks for. Every call is a no-op when the process was not started by
// systemd with Type=notify (NOTIFY_SOCKET unset), so the daemons call them unconditionally.
#pragma once

#include <chrono>
#include <string>

namespace conveyor::service {

void ready(const std::string& status);
void status(const std::string& status);
void stopping();
// Call from the daemon's main loop: sends WATCHDOG=1 when half the watchdog interval has
// passed since the last one (nothing when the unit has no watchdog).
void watchdog_tick();

}  // namespace conveyor::service

// Per-task times of a chain launch (tools/chain_timeline.py, docs/megakernel.md): where each task ran, when its
// consumers began and ended it, and how long it waited on a counter. Off (at null) by default: one uniform branch per
// mark. Task i's row [kTraceFields] of uint64 (globaltimer ns; kTraceWhere: SM << 32 | kind) is written when
// i < capacity; fields not marked stay as the caller zeroed them.
#pragma once

#include <cstdint>

#include "mok/common.cuh"

namespace mok::gemm {

enum TraceField { kTraceWhere, kTraceWaitBegin, kTraceWaitEnd, kTraceBegin, kTraceEnd, kTraceFields };

struct TaskTrace {
  uint64_t* at;  // null: off
  int capacity;

  MOK_DEVICE void mark(int task, TraceField field) const {
    if (at != nullptr && task < capacity) at[static_cast<int64_t>(task) * kTraceFields + field] = ptx::global_timer_ns();
  }
  // kTraceBegin, and where: this SM and the task's kind (the launch's numbering).
  MOK_DEVICE void begin(int task, int kind) const {
    if (at == nullptr || task >= capacity) return;
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    at[static_cast<int64_t>(task) * kTraceFields + kTraceWhere] = static_cast<uint64_t>(sm) << 32 | kind;
    mark(task, kTraceBegin);
  }
};

}  // namespace mok::gemm

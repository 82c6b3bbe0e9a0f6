#include "runtime/profiling.h"

namespace torchmpmd::runtime {

ProfilerContext ProfilerContext::current() {
  ProfilerContext context;
  context.callbacks_ = at::get_record_function_tls_();
  context.debug_info_ = c10::ThreadLocalDebugInfo::current();
  return context;
}

ProfilerContextGuard::ProfilerContextGuard(const ProfilerContext& context)
    : saved_callbacks_(at::get_record_function_tls_()),
      debug_info_(context.debug_info_) {
  at::set_record_function_tls_(context.callbacks_);
}

ProfilerContextGuard::~ProfilerContextGuard() {
  at::set_record_function_tls_(saved_callbacks_);
}

}  // namespace torchmpmd::runtime

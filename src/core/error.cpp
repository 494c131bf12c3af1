#include "core/error.h"

namespace memtune {

void assert_failed(const char* expr, const char* file, int line, const std::string& message) {
  std::string text = fmt::format("internal error at {}:{}: {}", file, line, expr);
  if (!message.empty()) text += " (" + message + ")";
  throw InternalError(text);
}

}  // namespace memtune

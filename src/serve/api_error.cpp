// OpenAI's error shape (see api_error.h).
#include "serve/api_error.h"

#include <nlohmann/json.hpp>

namespace memtune {

std::string api_error_type(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 413:
      return "request_too_large";
    case 429:
      return "rate_limit_error";
    case 503:
      return "service_unavailable";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

std::string api_error_body(int status, const std::string& message, const std::string& param, const std::string& code) {
  using json = nlohmann::json;
  const json body = {{"error",
                      {{"message", message},
                       {"type", api_error_type(status)},
                       {"param", param.empty() ? json(nullptr) : json(param)},
                       {"code", code.empty() ? json(nullptr) : json(code)}}}};
  return body.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace memtune

// How the server refuses a request: an HTTP status with OpenAI's error fields, and the one JSON
// shape every refusal is written in,
//   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}},
// so OpenAI's clients read our errors as theirs (the type follows from the status).
#pragma once

#include <stdexcept>
#include <string>

namespace memtune {

// A request refused: thrown by the parser and the handlers, written by the router.
struct ApiError : std::runtime_error {
  ApiError(int status, const std::string& message, std::string param = {}, std::string code = {})
      : std::runtime_error(message), status(status), param(std::move(param)), code(std::move(code)) {}
  int status;
  std::string param, code;  // empty: null in the body
};

// OpenAI's error type for an HTTP status: invalid_request_error for most 4xx.
std::string api_error_type(int status);

// The response body of a refusal. Never throws: a message quoting request text that is not
// valid UTF-8 has those bytes replaced by U+FFFD.
std::string api_error_body(int status, const std::string& message, const std::string& param = {},
                           const std::string& code = {});

}  // namespace memtune

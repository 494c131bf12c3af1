// A streamed completion on the wire: the HTTP response is given a chunked content provider that
// drains the request's channel into server-sent events (completion_response.h says which) as
// the engine produces text, sends a comment line after every second of silence so that a client
// that has gone away is noticed. on_end(complete) is called once when the response ends:
// complete is false when the connection ended early (the caller then cancels the request).
#pragma once

#include <functional>
#include <memory>

#include <httplib.h>

#include "serve/completion_response.h"
#include "serve/engine_loop.h"

namespace memtune {

void stream_completion(httplib::Response& res, const std::shared_ptr<Channel>& channel, CompletionResponse response,
                       bool include_usage, std::function<void(bool complete)> on_end);

}  // namespace memtune

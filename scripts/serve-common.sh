# Shared by the scripts that start `memtune serve` (sourced, not run).
# wait_for_server PID LOG: waits until the server logs its address (up to 2 minutes), then prints
# its base URL; exits with the log when the server stops first.
wait_for_server() {
  local pid="$1" log="$2"
  for _ in $(seq 600); do
    grep -q "on http://" "$log" && break
    kill -0 "$pid" 2> /dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.2
  done
  grep -o 'http://127.0.0.1:[0-9]*' "$log" | head -1
}

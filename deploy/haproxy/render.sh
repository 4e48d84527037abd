#!/bin/sh
# Print deploy/haproxy/haproxy.cfg with one `server` line per replica appended to its backend:
#   deploy/haproxy/render.sh 127.0.0.1:8081 127.0.0.1:8082 127.0.0.1:8083 > /etc/haproxy/haproxy.cfg
# Server names are r1, r2, ... in argument order; keep the order stable (a replica's name is its
# place on the hash ring). The config's default path to prefix_key.lua becomes this directory's
# absolute path (RADIXSERVE_ROUTER_LUA still overrides it).
set -eu
if [ "$#" -eq 0 ]; then
  echo "usage: $0 HOST:PORT [HOST:PORT ...]" >&2
  exit 2
fi
dir=$(cd "$(dirname "$0")" && pwd)
case "$dir" in
  *[\|\&\"]*) echo "$0: cannot write the path '$dir' into the config (it holds | & or \")" >&2; exit 2 ;;
esac
sed "s|\${RADIXSERVE_ROUTER_LUA-/usr/local/etc/haproxy/prefix_key.lua}|\${RADIXSERVE_ROUTER_LUA-$dir/prefix_key.lua}|" \
  "$dir/haproxy.cfg"
i=0
for addr in "$@"; do
  case "$addr" in
    *:*) ;;
    *) echo "$0: want HOST:PORT, got '$addr'" >&2; exit 2 ;;
  esac
  i=$((i + 1))
  echo "    server r$i $addr"
done

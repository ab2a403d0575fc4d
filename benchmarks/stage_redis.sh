#!/usr/bin/env bash
# Pack this machine's Debian redis-server (bookworm) with the libraries it links that a GPU
# image may lack, as redis-bookworm-<version>.tar.gz for gpu_serving.sh (which unpacks it in
# $STAGE and puts redis/ on PATH: redis/redis-server is a wrapper that sets the library path).
#   bash benchmarks/stage_redis.sh && ../shared/device/stage.sh file redis-bookworm-*.tar.gz
# (installs Debian's redis-server here first if it is missing).
set -euo pipefail
command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
bin=$(command -v redis-server)
version=$("$bin" --version | sed -n 's/.*v=\([0-9.]*\).*/\1/p')
tmp=$(mktemp -d)
mkdir -p "$tmp/redis/bin" "$tmp/redis/lib"
cp "$(readlink -f "$bin")" "$tmp/redis/bin/redis-server"
for lib in liblzf.so.1 libjemalloc.so.2 libsystemd.so.0 libssl.so.3 libcrypto.so.3 libatomic.so.1; do
  path=$(ldd "$bin" | awk -v l="$lib" '$1 == l {print $3}')
  [ -n "$path" ] && cp "$(readlink -f "$path")" "$tmp/redis/lib/$lib"
done
cat > "$tmp/redis/redis-server" <<'WRAP'
#!/usr/bin/env bash
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH=$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec "$here/bin/redis-server" "$@"
WRAP
chmod +x "$tmp/redis/redis-server" "$tmp/redis/bin/redis-server"
out=${1:-redis-bookworm-$version.tar.gz}
tar -czf "$out" -C "$tmp" redis
rm -rf "$tmp"
echo "packed $out ($(du -h "$out" | cut -f1))"

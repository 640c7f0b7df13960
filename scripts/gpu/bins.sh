# bins.sh: sourced by run.sh and multigpu.sh (repository root): sets BIN to the absolute path of
# $BIN_DIR (default .devbin/all), first unpacking every carried .devbin/NAME.tar.xz whose folder is
# missing (prepare.sh with PACK=1; .devbin/old and .devbin/alt for abbin the same way).
BIN_DIR=${BIN_DIR:-.devbin/all}
for pk in "$(dirname "$BIN_DIR")"/*.tar.xz; do
  if [ -f "$pk" ] && [ ! -d "${pk%.tar.xz}" ]; then
    tar -C "$(dirname "$pk")" -xJf "$pk" || { echo "cannot unpack $pk" >&2; exit 1; }
  fi
done
BIN=$(cd "$BIN_DIR" && pwd)

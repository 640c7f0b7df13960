B=.devbin/all/meddpm
for i in 1 2; do for f in "" --no-overlap; do
 $B bench --device cuda --preset whole-head --precision bf16 --layout ndhwc --iters 9 $f 2>&1 | grep -E '^cuda:0' | sed "s/^/[$f] /"; done; done

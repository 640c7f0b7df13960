//! Build script of the engine: embeds the bundled demo model when it exists.
//!
//! `testdata/demo/model.safetensors` (EMA weights of a demo-preset model trained with meddpm, see
//! docs/sample.md) is compiled into the binary with `include_bytes!` when the file is present at
//! build time, and not at all otherwise, so the workspace builds before the file is committed.
//! The generated `$OUT_DIR/bundled_model.rs` defines `BUNDLED: Option<&[u8]>`, read by
//! `checkpoint::bundled`. The build script reruns when anything in `testdata/demo/` changes
//! (a watched folder is scanned by cargo), so adding or replacing the file needs no clean build.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let demo = manifest.join("../../testdata/demo");
    let model = demo.join("model.safetensors");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", demo.display());
    let code = if model.is_file() {
        let abs = model.canonicalize().expect("the bundled model's path resolves");
        let lit = format!("{:?}", abs.to_str().expect("the bundled model's path is UTF-8"));
        format!("pub static BUNDLED: Option<&[u8]> = Some(include_bytes!({lit}));\n")
    } else {
        "pub static BUNDLED: Option<&[u8]> = None;\n".to_string()
    };
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("bundled_model.rs");
    std::fs::write(&out, code).expect("writing bundled_model.rs into OUT_DIR");
}

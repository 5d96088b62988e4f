//! Generates the Rust code for the CSI v1 gRPC API from `csi.proto`.
//!
//! Usage: `csi-codegen PROTO OUT_DIR`. PROTO is parsed with protox (a protobuf
//! compiler written in Rust, so no `protoc` binary is needed; it carries the
//! google/protobuf well-known imports itself), and tonic-prost-build writes
//! the messages and both the server and the client code to `OUT_DIR/csi.v1.rs`.
//! Run through `scripts/gen-csi-proto`, which pins the proto and adds a header.

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [proto, out_dir] = args.as_slice() else {
        eprintln!("usage: csi-codegen PROTO OUT_DIR");
        return ExitCode::from(2);
    };
    match generate(Path::new(proto), Path::new(out_dir)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("csi-codegen: {e}");
            ExitCode::FAILURE
        }
    }
}

fn generate(proto: &Path, out_dir: &Path) -> Result<(), String> {
    let include = proto
        .parent()
        .ok_or_else(|| format!("{}: no parent directory", proto.display()))?;
    let name = proto
        .file_name()
        .ok_or_else(|| format!("{}: no file name", proto.display()))?;
    let fds = protox::compile([name], [include])
        .map_err(|e| format!("compiling {}: {e:?}", proto.display()))?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // The client's `connect(uri)` helper (tests dial the driver's socket).
        .build_transport(true)
        .out_dir(out_dir)
        .compile_fds(fds)
        .map_err(|e| format!("generating code into {}: {e}", out_dir.display()))
}

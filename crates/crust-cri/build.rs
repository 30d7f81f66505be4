// Compiles the vendored CRI proto with protox (pure Rust, no `protoc`).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = "proto/cri-api.proto";
    println!("cargo:rerun-if-changed={file}");
    let fds = protox::compile([file], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}

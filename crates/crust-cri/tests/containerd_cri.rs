//! The CRI v1 client against the CRI plugin of a private containerd: the
//! runtime answers Version and Status, and the offline-imported images are
//! visible to ImageStatus in the CRI namespace. Budget: ~10 s (no guest).

use crust_cri::Cri;
use crust_cri::v1::{ImageSpec, ImageStatusRequest, StatusRequest, VersionRequest};
use crust_testkit::{BUSYBOX_IMAGE, CRI_NAMESPACE, Containerd, ContainerdOptions, PAUSE_IMAGE};

#[tokio::test]
async fn cri_client_talks_to_containerd() {
    crust_testkit::require_root();
    let (busybox, pause) = crust_testkit::ensure_test_images();
    let ctrd = Containerd::start(ContainerdOptions::default());
    ctrd.import_images(CRI_NAMESPACE, &[&busybox, &pause]);
    let mut cri = Cri::connect(&ctrd.endpoint()).await.unwrap();

    let v = cri
        .runtime
        .version(VersionRequest {
            version: "v1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(v.runtime_name, "containerd");
    assert_eq!(v.runtime_api_version, "v1");
    assert!(v.runtime_version.starts_with("1.6"), "{v:?}");

    let st = cri
        .runtime
        .status(StatusRequest { verbose: false })
        .await
        .unwrap()
        .into_inner();
    let conds = st.status.unwrap().conditions;
    let runtime_ready = conds.iter().find(|c| c.r#type == "RuntimeReady").unwrap();
    assert!(runtime_ready.status, "{conds:?}");
    // No CNI config: the network is not ready, so only host-network pods run.
    let net = conds.iter().find(|c| c.r#type == "NetworkReady").unwrap();
    assert!(!net.status, "{conds:?}");

    for image in [BUSYBOX_IMAGE, PAUSE_IMAGE] {
        let img = cri
            .image
            .image_status(ImageStatusRequest {
                image: Some(ImageSpec {
                    image: image.into(),
                    ..Default::default()
                }),
                verbose: false,
            })
            .await
            .unwrap()
            .into_inner()
            .image
            .unwrap_or_else(|| panic!("{image} not found through CRI"));
        assert!(img.repo_tags.iter().any(|t| t == image), "{img:?}");
    }
    let missing = cri
        .image
        .image_status(ImageStatusRequest {
            image: Some(ImageSpec {
                image: "crust.test/absent:latest".into(),
                ..Default::default()
            }),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(missing.image.is_none());
}

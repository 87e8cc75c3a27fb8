//! A replica-bus message as any client of the NATS server can publish it: with the fleet's key
//! or without, any bytes decode to a message or a refusal (unauthenticated frames before any
//! decompression), never a panic or an allocation beyond the bound.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prefix_router::replica_bus::auth::BusKey;
use prefix_router::replica_bus::wire::{self, Batch, Kind, SnapshotPart, SnapshotRequest};

fuzz_target!(|data: &[u8]| {
    let key = BusKey::new(b"the fuzzed fleet's shared key").unwrap();
    for k in [None, Some(&key)] {
        let _ = wire::decode::<Batch>(data, Kind::Batch, k);
        let _ = wire::decode::<SnapshotPart>(data, Kind::SnapshotPart, k);
        let _ = wire::decode::<SnapshotRequest>(data, Kind::SnapshotRequest, k);
    }
    // The same bytes as a correctly signed frame: past the tag, into decompression and msgpack.
    let tag = key.tag(&[&wire::SIGNED_TAG, data]);
    let signed = [&wire::SIGNED_TAG[..], &tag, data].concat();
    let _ = wire::decode::<Batch>(&signed, Kind::Batch, Some(&key));
    let _ = wire::decode::<SnapshotPart>(&signed, Kind::SnapshotPart, Some(&key));
});

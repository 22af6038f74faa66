//! ember: a small microVM monitor for Linux/KVM, and the tools that show where
//! every millisecond of a boot goes.
//!
//! This crate is the command line and the tools around the VMM: `ember boot`
//! ([`boot`]), the appliance (`ember run -- CMD`, [`appliance`]), the boot lab
//! ([`lab`]) and the VMMs it drives ([`backend`]). The VMM itself is the
//! `ember-vmm` crate, used only through its public API.

pub mod api;
pub mod appliance;
pub mod backend;
pub mod boot;
pub mod cleanup;
pub mod container;
pub mod exit;
pub mod initramfs;
pub mod lab;
pub mod netns;
pub mod passt;
pub mod rtnl;
pub mod terminal;
pub mod tool;

pub mod bench;
pub mod demo;
pub mod run;

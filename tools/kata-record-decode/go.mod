module crust.local/kata-record-decode

go 1.19

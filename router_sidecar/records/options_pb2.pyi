from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor
SPARSE_FIELD_NUMBER: _ClassVar[int]
sparse: _descriptor.FieldDescriptor
OMIT_UNSET_FIELD_NUMBER: _ClassVar[int]
omit_unset: _descriptor.FieldDescriptor
HEADER_FIELD_NUMBER: _ClassVar[int]
header: _descriptor.FieldDescriptor

"""Quantisation into moed's repack format (ext/formats/repacked.py defines the format):
choosing each group's codes, scale and minimum (codec.py), the importance of each input
column gathered from calibration text (importance.py), and writing a repacked model
directory (repack.py). The codecs are numpy only and never use the kernels. Imports
quant/, models/ and formats/ (ext/models/ to read a model and run it over calibration
text)."""

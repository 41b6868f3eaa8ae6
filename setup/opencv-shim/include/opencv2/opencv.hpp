// FFCV's C++ extension includes <opencv2/opencv.hpp> but only calls cv::resize (and turbojpeg for JPEG).
// Debian's small OpenCV dev packages (core, imgproc) ship an opencv.hpp that pulls in every module's header,
// so this shim stands in for it and includes only the two modules that are installed.
#pragma once
#include <opencv2/core.hpp>
#include <opencv2/imgproc.hpp>
